"""`compile=True`: the per-rank program through inductor, forward and backward.

float64, so that 1e-12 holds whatever inductor fuses. torch.compile is slow
on a small CPU machine, so each runtime compiles one small program: the
simulator a GPT block at [2, 2, 2] (selective checkpointing: recompute
regions in the compiled backward) and 1-D over p=4; one gloo launch the same
1-D program as the simulator, which inductor's cache then mostly serves.
The oracle is the unsharded model; the collectives per phase must be the
eager simulator's (the products' backward fetches again, nothing is kept).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from models import GPTBlock

import tess_compile
from tess_compile.core.layout import local_block
from tess_compile.core.mesh import Mesh
from tess_compile.runtime.launch import run_local
from tess_compile.runtime.threaded import grad_in_thread

TOL = 1e-12
# (q, d, mode, heads, checkpoint): one program per runtime, see the module docstring.
SIMULATED = [(2, 2, "2.5d", 2, "selective"), (1, 4, "1d", 4, "none")]
HIDDEN, SEQ, BATCH = 8, 4, 4


def make_case(heads: int):
    """A float64 GPT block with distinct weights, an input and loss weights (the same on every rank)."""
    torch.manual_seed(3)
    model = GPTBlock(HIDDEN, heads).double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    target = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    return model, x, target


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(expected.abs().max().item(), 1e-12)
    return (actual.detach() - expected.detach()).abs().max().item() / scale


def oracle(model, x, target):
    """The unsharded model's output and gradients of `(y * target).sum()`."""
    reference = copy.deepcopy(model)
    y = reference(x)
    (y * target).sum().backward()
    return y, {name: p.grad for name, p in reference.named_parameters()}


@pytest.mark.parametrize("q, d, mode, heads, checkpoint", [pytest.param(*SIMULATED[0], marks=pytest.mark.slow),
                                                            SIMULATED[1]], ids=["q2d2-selective", "1d-p4"])
def test_simulated_compiled_parity(q, d, mode, heads, checkpoint, monkeypatch):
    model, x, target = make_case(heads)
    expected, grads = oracle(model, x, target)
    options = dict(example_inputs=(x,), mode=mode, recompute=checkpoint)
    sim = tess_compile.simulate(model, q, d, compile=True, **options)
    y = sim(x)
    engine_threads = _engine_callers(monkeypatch)
    (y * target).sum().backward()
    # The ranks' backwards run in their threads outside the autograd engine, which on CUDA runs every
    # node on one device thread: ranks that meet at collectives there hang (they did, on a GPU).
    assert engine_threads == {threading.main_thread().name}
    assert rel_err(y, expected) <= TOL
    errors = {name: rel_err(grad, grads[name]) for name, grad in sim.full_grads().items()}
    assert list(errors) == list(grads) and max(errors.values()) <= TOL, errors

    # The eager simulator's collectives: the products' backward broadcasts again (nothing kept).
    eager = tess_compile.simulate(model, q, d, **options)
    (eager(x) * target).sum().backward()
    for phase in ("forward", "backward"):
        assert sim.comm.counts(phase) == eager.comm.counts(phase), phase


def _engine_callers(monkeypatch) -> set:
    """The names of the threads that call the autograd engine from now on (the set fills as they do)."""
    callers, run = set(), torch.autograd.graph._engine_run_backward

    def spy(*args, **kwargs):
        callers.add(threading.current_thread().name)
        return run(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "_engine_run_backward", spy)
    return callers


class _Twice(torch.autograd.Function):
    """Two outputs, a Python backward that takes None for a gradient that did not arrive, and
    arguments that are no tensors or need no gradient (a compiled function's sizes and constants)."""

    @staticmethod
    def forward(ctx, scale, x, constant):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * scale + constant, x.sin()

    @staticmethod
    def backward(ctx, g_scaled, g_sin):
        (x,) = ctx.saved_tensors
        grad = torch.zeros_like(x)
        if g_scaled is not None:
            grad = grad + ctx.scale * g_scaled
        if g_sin is not None:
            grad = grad + x.cos() * g_sin
        return None, grad, None


def test_grad_in_thread_matches_the_engine():
    """Built-in and Python nodes, a node reached twice, an output that is an input, an unused
    input, an output whose gradient does not arrive."""
    torch.manual_seed(0)
    a, b, unused = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    double, sine = _Twice.apply(2, a @ b.T, torch.ones(3, 3, dtype=torch.float64))
    shared = (a * b).sum(1)
    roots = [double.exp().sum(0), shared * 3, shared.cos(), b, sine]
    grads = [torch.randn_like(r) for r in roots[:-1]] + [None]
    expected = torch.autograd.grad([r for r, g in zip(roots, grads) if g is not None],
                                   [a, b, unused], [g for g in grads if g is not None], retain_graph=True,
                                   allow_unused=True)
    kept = [(r, g) for r, g in zip(roots, grads) if g is not None]
    found = grad_in_thread([r for r, _ in kept], [a, b, unused], [g for _, g in kept])
    assert found[2] is None and expected[2] is None
    for mine, theirs in zip(found[:2], expected[:2]):
        assert torch.allclose(mine, theirs, rtol=1e-14, atol=0)


def test_simulated_compiled_eval_and_second_call():
    """No grad: the inference graph; a second call reuses the compiled program."""
    q, d, mode, heads, checkpoint = SIMULATED[1]
    model, x, _ = make_case(heads)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode, compile=True)
    with torch.no_grad():
        first, second = sim(x), sim(x)
        assert rel_err(first, model(x)) <= TOL and torch.equal(first, second)
    assert len(sim._compiled) == 1


def test_compile_option_errors():
    model, x, _ = make_case(2)
    with pytest.raises(ValueError, match=r"inner='cuda'.*'eager', 'inductor'.*inner='inductor'"):
        tess_compile.backend(2, 2, inner="cuda")
    with pytest.raises(ValueError, match=r"compile='inductor'.*is True .* or False .*'reduce-overhead'"):
        tess_compile.simulate(model, 2, 2, example_inputs=(x,), compile="inductor")
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(x,), compile="max-autotune-no-cudagraphs")
    assert sim.compile == "max-autotune-no-cudagraphs"  # inductor's mode, taken as torch.compile takes it


def _gloo_worker(rank, world_size):
    torch.set_num_threads(1)
    q, d, mode, heads, _ = SIMULATED[1]
    mesh = Mesh(q, d, mode)
    model, x, target = make_case(heads)
    expected, grads = oracle(model, x, target)
    sm = tess_compile.shard(model, q, d, example_inputs=(x,), mode=mode, compile=True, timeout=60)
    y = tess_compile.full_tensor(sm(x))
    (y * target).sum().backward()
    errors = {"output": rel_err(y, expected)}
    for slot in sm.program.params:
        grad = dict(sm.named_parameters())[slot.name].grad
        errors[slot.name] = rel_err(grad.to_local(), local_block(grads[slot.name], slot.layout, mesh, rank))
    # On process groups the compiled graphs' collectives are functional collectives, which the communicator
    # does not record: count those of the graphs inductor compiled (docs/compiled.md).
    assert sm.comm.records == []
    (compiled,) = sm._compiled.values()
    return errors, *(_graph_counts(compiled, phase) for phase in ("forward", "backward"))


def _graph_counts(compiled, phase: str) -> dict:
    """Collectives per (op, axis) of the graphs of `phase` that a `CompiledRank` compiled."""
    counts = {}
    for graph in compiled.graphs:
        for record in graph.collectives if graph.phase == phase else ():
            counts[(record.op, record.axis)] = counts.get((record.op, record.axis), 0) + 1
    return counts


@pytest.mark.slow
def test_gloo_compiled_parity():
    q, d, mode, heads, _ = SIMULATED[1]
    results = run_local(_gloo_worker, Mesh(q, d, mode).num_ranks, timeout_s=300, collective_timeout_s=60)
    for rank, (errors, forward, backward) in enumerate(results):
        assert len(errors) == 1 + len(list(GPTBlock(HIDDEN, heads).parameters()))
        assert max(errors.values()) <= TOL, (rank, errors)
        assert (forward, backward) == results[0][1:] and sum(backward.values()) > 0
