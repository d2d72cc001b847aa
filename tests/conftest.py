"""Shared fixtures and helpers of the simulation suite."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

# `from models import ...` and `from conftest import ...` in the test files.
sys.path.insert(0, os.path.dirname(__file__))

from models import MESHES  # noqa: F401  (re-exported for the tests)

# Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads: two workers of
# two threads each on two cores would slice each other's time.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import tess_compile
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops
from tess_compile.passes.observers import add_pass_observer, remove_pass_observer


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(items):
    """The fast tier keeps one small case of each feature, on the small meshes. A case on a mesh of side
    q > 2 (a parameter `q` or `qq`), and a case on [2, 2, 1] whose [2, 2, 2] twin (the same parameters but
    d = 2, the case with depth) runs too, run in the slow tier: the same feature at other sizes."""
    cases = {_case_key(item, _params(item)) for item in items}
    for item in items:
        params = _params(item)
        q, d = (next((params[name] for name in names if isinstance(params.get(name), int)), None)
                for names in (("q", "qq"), ("d", "dd")))
        twin = q == 2 and d == 1 and _case_key(item, params, d=2) in cases
        if (q is not None and q > 2) or twin:
            item.add_marker(pytest.mark.slow)


def _params(item) -> dict:
    return item.callspec.params if hasattr(item, "callspec") else {}


def _case_key(item, params: dict, **changed) -> tuple:
    """The test function and its parameters (`changed` replaced: the depth, as `d` or `dd`)."""
    values = dict(params)
    for name in ("d", "dd"):
        if name in values and changed:
            values[name] = changed["d"]
    return (item.nodeid.split("[")[0], tuple(sorted((name, repr(value)) for name, value in values.items())))


@pytest.fixture(autouse=True)
def _deterministic():
    """TF32 off (an oracle at fp32 needs fp32 matmuls) and fixed seeds."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    _set_cudnn_tf32(False)
    torch.manual_seed(0)
    yield
    torch.backends.cuda.matmul.allow_tf32 = old[0]
    _set_cudnn_tf32(old[1])


@pytest.fixture(scope="session")
def gpt2_generating():
    """The GPT-2 of tests/test_generation.py simulated on [2, 2, 2] with dynamic=True, its generation programs
    compiled by a first call on 4 prompts: (the model, the simulated module, the captures of that call). The
    generation tests share it (one compile a worker) and leave its programs as they are."""
    from test_generation import compiled, gpt2

    model = gpt2()
    return (model, *compiled(model, 2, 2))


@pytest.fixture
def fake_mesh():
    """A `(2, 2, 2)` DeviceMesh named like the runtime's, on torch's fake process group (a world of 8
    in this process, no data moved)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("depth", "row", "col"))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of this one process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _set_cudnn_tf32(value: bool) -> None:
    """cudnn's TF32 switch. torch's own test utilities (imported by PyTorch's test
    Transformer in the coverage zoo) freeze cudnn's flags; frozen, the switch stays
    as it is, off since the first test."""
    if torch.backends.cudnn.allow_tf32 != value and not torch.backends.flags_frozen():
        torch.backends.cudnn.allow_tf32 = value


def assert_close_rel(actual, expected, rtol: float = 1e-5, name: str = "tensor") -> None:
    """Elementwise |a - e| <= rtol * max(max|e|, 1e-12) + rtol * |e|.

    The first term scales with the tensor's largest element, so elements
    near zero (cancellations) do not fail spuriously.
    """
    assert actual is not None, f"{name}: got None"
    assert isinstance(actual, torch.Tensor), f"{name}: got {type(actual).__name__}, not a tensor"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {list(actual.shape)} != expected {list(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != expected {expected.dtype}"
    a, e = actual.detach().double(), expected.detach().double()
    finite = torch.isfinite(e)
    if not finite.all():
        assert torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()), f"{name}: non-finite values differ"
        a, e = a[finite], e[finite]
    scale = max(e.abs().max().item() if e.numel() else 0.0, 1e-12)
    err = (a - e).abs()
    bound = rtol * scale + rtol * e.abs()
    bad = ~(err <= bound)  # NaN in `actual` counts as a mismatch
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {e.numel()} elements differ beyond rtol={rtol} "
            f"(max abs err {err.max().item():.3e}, scale {scale:.3e}); first at {list(index)}: "
            f"actual {a[index].item():.8g} vs expected {e[index].item():.8g}"
        )


def assert_matches_model(sim, model, *inputs, rtol: float = 1e-5):
    """The simulated model's output, and every parameter gradient after the backward of
    a fixed random projection of it, equal the unsharded model's. Returns the output."""
    out, expected = sim(*inputs), model(*inputs)
    assert_close_rel(out, expected, rtol, "output")
    target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1234), dtype=expected.dtype)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, rtol, f"grad {name}")
    return out


# A gradient element below this fraction of the model's largest is the rounding noise of a gradient that is
# mathematically zero (a key bias under softmax): AdamW divides it by its own root mean square (or by eps) and
# turns it into an lr-sized step whose sign the summation order decides, so no weight after AdamW is compared there.
NULL_GRADIENT = 1e-8


def null_gradients(model: torch.nn.Module, earlier: dict | None = None) -> dict[str, torch.Tensor]:
    """Per parameter of `model` (the unsharded oracle, after a backward), the elements whose gradient is
    below NULL_GRADIENT times the model's largest, or were in `earlier` (the masks of earlier steps)."""
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    scale = max(g.abs().max().item() for g in grads.values())
    masks = dict(earlier or {})
    for name, grad in grads.items():
        null = grad.abs() <= NULL_GRADIENT * scale
        masks[name] = null | masks[name] if name in masks else null
    return masks


def trained_error(actual: torch.Tensor, expected: torch.Tensor, null: torch.Tensor | None) -> float:
    """max |actual - expected| over max |expected|, where the gradient was not null (see NULL_GRADIENT)."""
    keep = torch.ones_like(expected, dtype=torch.bool) if null is None else ~null
    scale = expected.abs().max().item()
    return ((actual - expected)[keep].abs().max().item() if keep.any() else 0.0) / max(scale, 1e-300)


def simulate_exact(build, inputs: tuple, q: int, d: int, mode: str, gathers: bool = False, strict: bool = True):
    """Simulate the float64 model that `build()` makes with every op sharded (`strict`) and no
    warning (`gathers`: but for views that gather their input), check every output (float ones to
    1e-12, integer ones equal) and every parameter gradient against a second one built alike (the
    old weight_norm's modules cannot be deep-copied), and return the simulated module with its
    redundant work."""
    model, oracle = (seeded(build) for _ in range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = tess_compile.simulate(model, q, d, example_inputs=inputs, mode=mode, strict=strict, verify=True)
    unexpected = ("replicated",) if gathers else ("replicated", "whole")
    assert not [str(w.message) for w in caught if any(word in str(w.message) for word in unexpected)]
    outs, expected = _outputs(sim(*inputs)), _outputs(oracle(*inputs))
    loss, oracle_loss = 0.0, 0.0
    for index, (out, exp) in enumerate(zip(outs, expected)):
        if not exp.is_floating_point():
            assert torch.equal(out, exp), f"output {index}: {out} != {exp}"
            continue
        assert_close_rel(out, exp, 1e-12, f"output {index}")
        target = torch.randn(exp.shape, generator=torch.Generator().manual_seed(index), dtype=exp.dtype)
        loss, oracle_loss = loss + (out * target).sum(), oracle_loss + (exp * target).sum()
    loss.backward()
    oracle_loss.backward()
    grads = sim.full_grads()
    for name, param in oracle.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name}")
    return sim, redundant_work(sim.program, unsharded_forward_flops(oracle, inputs))


def seeded(build) -> torch.nn.Module:
    """`build()` after torch.manual_seed(0), in float64."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        return build().double()


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@contextlib.contextmanager
def counting_captures():
    """A list that gets one entry per capture (one per compile) while the context is open."""
    captures = []

    def observer(result):
        if result.name == "capture":
            captures.append(result)

    add_pass_observer(observer)
    try:
        yield captures
    finally:
        remove_pass_observer(observer)
