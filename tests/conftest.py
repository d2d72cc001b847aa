"""Shared fixtures and helpers of the simulation suite."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

# `from models import ...` and `from conftest import ...` in the test files.
sys.path.insert(0, os.path.dirname(__file__))

from models import MESHES  # noqa: E402,F401  (re-exported for the tests)

from passes.observers import add_pass_observer, remove_pass_observer


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
