"""Third-party architectures, sharded and exact: every model of
`benchmarks/architectures.py` at 2.5-D [2,2,2] and 1-D p=4, in float64.

Each case runs one forward and backward in simulation and compares the loss
and every parameter's full gradient with the unsharded model's
(`benchmarks/coverage.py`, which also prints the table of docs/coverage.md):

- exact: the largest difference relative to the model's largest gradient is
  at most 1e-12, or 1e-5 for a model whose own code computes in float32 (Llama's
  RMSNorm and rotary tables, T5's norm cast `.to(torch.float32)` even in a
  float64 model, so float32 rounding in another summation order is the floor);
- no redundant work: forward FLOPs over all ranks at most 1.05 times the
  unsharded model's.

A library that is not installed skips its models. `KNOWN_LIMITS` are the cases
that do not meet the bound yet, each with its reason (strict xfail: one that
starts passing fails the suite, so the list stays true).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import coverage  # noqa: E402
from benchmarks.architectures import ARCHITECTURES  # noqa: E402

pytestmark = pytest.mark.slow  # the whole file: the architecture zoo

MAX_REDUNDANT = 1.05
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}

# (architecture, mode) -> why it fails: a strict xfail, so that a fix shows (none at present)
KNOWN_LIMITS: dict[tuple[str, str], str] = {}

CASES = [
    pytest.param(name, label, q, d, mode, id=f"{name}-{mode}",
                 marks=[pytest.mark.xfail(strict=True, reason=KNOWN_LIMITS[name, mode])] if (name, mode) in KNOWN_LIMITS else [])
    for name in ARCHITECTURES
    for label, q, d, mode in coverage.MESHES
]


@pytest.mark.parametrize("name, label, q, d, mode", CASES)
def test_architecture_is_exact_and_sharded(name, label, q, d, mode):
    library = ARCHITECTURES[name][0]
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    row = coverage.measure(name, label, q, d, mode)
    assert row.failure is None, f"{name} on {label}: {row.failure}"
    tolerance = TOLERANCE[row.compute_dtype]
    assert row.error <= tolerance, f"{name} on {label}: error {row.error:.2e} > {tolerance:.0e} (computes in {row.compute_dtype})"
    assert row.redundant is None or row.redundant <= MAX_REDUNDANT, (
        f"{name} on {label}: redundant work {row.redundant:.2f} > {MAX_REDUNDANT}; replicated ops: {row.replicated}"
    )
