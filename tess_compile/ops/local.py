"""Rank-local graph targets that are not kernels of torch: the run-time device, an
`arange` on it, and the range check of indices.

A per-rank graph may run on another device than the one the model was
captured on (a CUDA run of a CPU capture, a fake run on the meta device), so
the graph reads the device of an input at run time (`device_of`) and makes
index vectors there (`arange_like`). `check_in_range` raises torch's own
IndexError for an index outside a table, which a sharded lookup would
otherwise turn into zeros (`tess_compile.passes.rules.index_checks` places the checks).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.node import has_side_effect

__all__ = ["arange_like", "check_in_range", "device_of"]


def device_of(x: torch.Tensor) -> torch.device:
    """x's device (a graph target: the device is known at run time only)."""
    return x.device


def arange_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """0..n-1 on x's device (a graph target: the device is known at run time only)."""
    return torch.arange(n, device=x.device)


def _fake_or_meta(x: torch.Tensor) -> bool:
    if x.is_meta or is_fake(x):
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@has_side_effect
def check_in_range(values: torch.Tensor, size: int, noun: str, owner: str, ignore_index: int | None = None) -> None:
    """IndexError if an element of `values` lies outside [0, size) (and is not
    `ignore_index`). A graph target: skipped on fake and meta tensors (compile-time
    runs); on CUDA an asynchronous assert, so that the check does not synchronise."""
    if _fake_or_meta(values) or values.numel() == 0:
        return
    valid = (values >= 0) & (values < size)
    if ignore_index is not None:
        valid |= values == ignore_index
    allowed = f"[0, {size})" + ("" if ignore_index is None else f" or equal ignore_index {ignore_index}")
    if values.is_cuda:
        torch._assert_async(valid.all(), f"a {noun} is out of range for {owner}: it must be in {allowed}")
        return
    if not bool(valid.all()):
        bad = int(values[~valid].reshape(-1)[0])
        raise IndexError(f"{noun} {bad} is out of range for {owner}: {noun}s must be in {allowed}")
