"""The gradients `local_tensors` gives DTensor parameters: accumulated into `.grad` by its own
autograd node where AccumulateGrad would do just that, and through autograd wherever something
else must see them. The reference is the mathematics (a gradient summed over backwards), not
torch: torch's AccumulateGrad lets two overlapping views of one gradient become two leaves'
`.grad`, and a second backward then adds into both (`test_overlapping_views_accumulate_apart`).

DTensors on torch's fake process group (a mesh of 8 in this process, no data moved), a sharded
module on a gloo world of one process, and (slow) two accumulated backwards over 8 gloo processes
against the unsharded model; float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import tess_compile
from tess_compile.core.mesh import Mesh
from tess_compile.passes.driver import compile_model
from tess_compile.runtime.dtensors import local_tensors
from tess_compile.runtime.sharded_module import shard_program

WEIGHT = torch.linspace(-1, 1, 12, dtype=torch.float64).view(4, 3)


def _params(mesh, count: int = 2) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [nn.Parameter(DTensor.from_local(torch.randn(4, 3, dtype=torch.float64, generator=generator), mesh,
                                            (Replicate(), Shard(0), Shard(1)), run_check=False)) for _ in range(count)]


def _grads(params) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in params]


def test_shared_gradient_accumulates_apart(fake_mesh):
    """`a + b`: autograd hands both locals one gradient tensor. Each `.grad` gets its own storage,
    so a second backward adds to each once (before: both `.grad` shared it and got the sum twice)."""
    params = _params(fake_mesh)
    for _ in range(2):
        a, b = local_tensors(params)
        ((a + b) * WEIGHT).sum().backward()
    assert params[0].grad.to_local().data_ptr() != params[1].grad.to_local().data_ptr()
    for grad in _grads(params):
        assert torch.equal(grad, 2 * WEIGHT)


def test_overlapping_views_accumulate_apart(fake_mesh):
    """`(a.t() + b.t()) @ w`: each local's gradient is another view of one tensor."""
    params = _params(fake_mesh)
    w = torch.linspace(0, 1, 8, dtype=torch.float64).view(4, 2)
    for _ in range(2):
        a, b = local_tensors(params)
        ((a.t() + b.t()) @ w).sum().backward()
    expected = 2 * (w @ torch.ones(2, 3, dtype=torch.float64))  # d/da of sum((a^T + b^T) w), twice
    for grad in _grads(params):
        assert torch.equal(grad, expected)


def test_gradient_into_existing_grad_in_place(fake_mesh):
    """`zero_grad(set_to_none=False)`: the next backward adds into the same `.grad` tensors."""
    params = _params(fake_mesh)
    ((local_tensors(params)[0] + local_tensors(params)[1]) * WEIGHT).sum().backward()
    held = [p.grad for p in params]
    for p in params:
        p.grad.zero_()
    a, b = local_tensors(params)
    (a * WEIGHT + 3 * b * WEIGHT).sum().backward()
    assert [p.grad for p in params] == held
    assert torch.equal(params[0].grad.to_local(), WEIGHT) and torch.equal(params[1].grad.to_local(), 3 * WEIGHT)
    assert params[0].grad.placements == (Replicate(), Shard(0), Shard(1))


def test_strided_gradient_takes_the_parameter_layout(fake_mesh):
    """A transposed local gradient is stored in the parameter's strides (the gradient layout
    contract AccumulateGrad keeps), as a DTensor placed like the parameter."""
    (param,) = _params(fake_mesh, 1)
    (local,) = local_tensors([param])
    (local.t() * WEIGHT.t()).sum().backward()
    assert param.grad.to_local().stride() == param.to_local().stride()
    assert param.grad.stride() == param.stride() and param.grad.shape == param.shape
    assert torch.equal(param.grad.to_local(), WEIGHT)


def test_hooks_and_autograd_grad_see_the_gradients(fake_mesh):
    """Where autograd must see a gradient, it gets one: a tensor hook and a post-accumulate hook
    fire with DTensor gradients, a hook on the AccumulateGrad node fires with `.grad` in place,
    `torch.autograd.grad` returns the gradients, `backward(inputs=...)` fills only those, under
    `create_graph` the gradients are recorded, and a parameter frozen after forward gets none."""
    params = _params(fake_mesh, 3)
    seen = []
    params[0].register_hook(lambda grad: seen.append(("hook", type(grad))))
    params[1].register_post_accumulate_grad_hook(lambda p: seen.append(("post", type(p.grad))))
    node = params[2].view_as(params[2]).grad_fn.next_functions[0][0]
    node.register_hook(lambda *_: seen.append(("node", type(params[2].grad))))

    def loss():
        return sum((x * WEIGHT).sum() for x in local_tensors(params))

    loss().backward()
    assert sorted(seen) == [("hook", DTensor), ("node", DTensor), ("post", DTensor)]
    for grad in _grads(params):
        assert torch.equal(grad, WEIGHT)

    fresh = _params(fake_mesh, 3)
    grads = torch.autograd.grad(sum((x * WEIGHT).sum() for x in local_tensors(fresh)), fresh)
    assert all(isinstance(g, DTensor) and torch.equal(g.to_local(), WEIGHT) for g in grads)
    assert all(p.grad is None for p in fresh)

    sum((x * WEIGHT).sum() for x in local_tensors(fresh)).backward(inputs=[fresh[1]])
    assert fresh[0].grad is None and fresh[2].grad is None and torch.equal(fresh[1].grad.to_local(), WEIGHT)

    (grad,) = torch.autograd.grad((local_tensors(fresh[:1])[0] ** 2).sum(), fresh[:1], create_graph=True)
    assert grad.requires_grad and torch.equal(grad.to_local(), 2 * fresh[0].to_local())

    frozen = _params(fake_mesh, 1)  # frozen between forward and backward: AccumulateGrad drops its gradient
    loss = (local_tensors(frozen)[0] * WEIGHT).sum()
    frozen[0].requires_grad_(False)
    loss.backward()
    assert frozen[0].grad is None


class _Offset(nn.Module):
    """An output that is a parameter plus the input: the output's gradient is the parameter's."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(2, 4, dtype=torch.float64))

    def forward(self, x):
        return x + self.offset


@pytest.mark.parametrize("wrapped", [True, False])
def test_output_gradient_passed_through_stays_the_callers(world_of_one, wrapped):
    """A gradient given to `backward` that reaches a parameter unchanged (output = parameter + input)
    is copied into `.grad`: the caller's tensor is not `.grad`, and a second backward with the same
    tensor adds it once more. Both with a DTensor output and with the program's own (unwrapped)."""
    x = torch.randn(2, 4, dtype=torch.float64)
    if wrapped:
        module = tess_compile.shard(_Offset(), 1, 1, example_inputs=(x,), timeout=60)
    else:
        program = compile_model(_Offset(), Mesh(1, 1), (x,))
        module = shard_program(program, timeout=60, wrap_outputs=False)
    given = torch.linspace(0, 1, 8, dtype=torch.float64).view(2, 4)
    for _ in range(2):
        out = module(x)
        gradient = DTensor.from_local(given, out.device_mesh, out.placements, run_check=False) if wrapped else given
        out.backward(gradient)
    assert torch.equal(given, torch.linspace(0, 1, 8, dtype=torch.float64).view(2, 4))
    assert torch.equal(module.offset.grad.to_local(), 2 * given)


def test_pieces_of_one_buffer_are_taken_as_they_are(fake_mesh):
    """Gradients that are disjoint views of one buffer (a gradient bucket's pieces; here a `cat`'s)
    become `.grad` without a copy, and accumulate apart."""
    params = _params(fake_mesh)
    for step in range(2):
        a, b = local_tensors(params)
        (torch.cat([a.reshape(-1), b.reshape(-1)]) * torch.arange(24, dtype=torch.float64)).sum().backward()
        if step == 0:
            storages = {p.grad.to_local().untyped_storage().data_ptr() for p in params}
            assert len(storages) == 1, "both pieces of the one gradient buffer, uncopied"
    ramp = torch.arange(24, dtype=torch.float64)
    assert torch.equal(params[0].grad.to_local(), 2 * ramp[:12].view(4, 3))
    assert torch.equal(params[1].grad.to_local(), 2 * ramp[12:].view(4, 3))


def _accumulated_gradients(rank: int, world_size: int):
    """Two backwards without zeroing on a GPT block at [2,2,2] (gradient buckets included): the worst
    relative error of any gradient against the unsharded block's, and how many gradients the
    parameters' node copied (none: every gradient is autograd's own, or a bucket's disjoint piece)."""
    from models import GPTBlock

    from tess_compile.runtime import dtensors

    torch.manual_seed(0)
    model, x = GPTBlock(8, 4).double(), torch.randn(8, 4, 8, dtype=torch.float64)
    sharded = tess_compile.shard(copy.deepcopy(model), 2, 2, example_inputs=(x,), timeout=120)
    copied = []
    owned = dtensors._owned
    dtensors._owned = lambda *args: copied.append(not owned(*args)) or not copied[-1]
    for _ in range(2):
        tess_compile.full_tensor(sharded(x)).square().sum().backward()
        model(x).square().sum().backward()
    errors = [(sharded.get_parameter(name).grad.full_tensor() - p.grad).abs().max() / p.grad.abs().max()
              for name, p in model.named_parameters()]
    return max(errors).item(), sum(copied)


@pytest.mark.slow
def test_accumulated_gradients_at_2_2_2():
    from tess_compile.runtime.launch import run_local

    for error, copied in run_local(_accumulated_gradients, 8, timeout_s=300):
        assert error <= 1e-12 and copied == 0


def test_compiled_autograd_gives_every_gradient(world_of_one):
    """Under compiled autograd the parameters' node runs in compiled autograd's graph with a stand-in
    ctx: every gradient goes to its AccumulateGrad (before: none reached `.grad`). Two backwards of an
    MLP at a world of one against the unsharded MLP's, float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    sharded = tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=(x,), timeout=60)
    torch._dynamo.reset()
    with torch._dynamo.compiled_autograd._enable(lambda graph: graph):  # its graph run as it is, by FX
        for _ in range(2):
            sharded(x).to_local().square().sum().backward()
    torch._dynamo.reset()
    for _ in range(2):
        model(x).square().sum().backward()
    for name, param in model.named_parameters():
        grad = sharded.get_parameter(name).grad
        assert grad is not None, name
        torch.testing.assert_close(grad.to_local(), param.grad, rtol=1e-13, atol=1e-13, msg=name)
