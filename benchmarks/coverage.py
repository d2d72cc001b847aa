"""Coverage of real architectures: exactness and redundant work, per mesh.

For every model of `benchmarks/architectures.py` and every mesh (2.5-D
[2,2,2] and 1-D p=4 by default), the model is simulated in float64, and one
forward and backward is compared with the unsharded model's:

- `error`: the largest difference of the loss and of any parameter's full
  gradient, relative to the largest gradient of the model (some gradients
  are mathematically zero, so each is measured on the model's scale);
- `redundant`: forward FLOPs over all ranks over the unsharded model's
  (`tess_compile.analysis.accounting.redundant_work`; 1.00: no rank repeats another's
  matmul-like work);
- `replicated`: the ops with no sharding rule (they run whole on every rank);
- `computes in`: float64, or the least precise dtype the model's own graph
  casts a float64 value down to (Llama's RMSNorm computes in float32 even in
  a float64 model: then float32 rounding in another summation order bounds
  the error).

A model that does not compile gets its error's first line instead.

    python3 benchmarks/coverage.py [--models gpt2 bert ...] [--markdown]
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile  # noqa: E402
from benchmarks.architectures import ARCHITECTURES, build  # noqa: E402
from passes.capture import capture
from tess_compile.analysis.accounting import captured_forward_flops, redundant_work
from tess_compile.core.program import split_example_inputs

__all__ = ["MESHES", "Row", "main", "measure"]

# (label, q, d, mode)
MESHES = [("2.5d [2,2,2]", 2, 2, "2.5d"), ("1d p=4", 2, 1, "1d")]


@dataclass
class Row:
    name: str
    mesh: str
    error: float | None = None
    redundant: float | None = None
    replicated: list[str] = field(default_factory=list)
    failure: str | None = None
    compute_dtype: torch.dtype | None = None


def _relative_error(sim, oracle, out, expected, loss) -> float:
    """max |difference| of the loss and every full gradient over the largest gradient."""
    scale = max(p.grad.abs().max().item() for p in oracle.parameters() if p.grad is not None)
    worst = (loss(out) - loss(expected)).abs().item() / max(loss(expected).abs().item(), 1e-300)
    grads = sim.full_grads()
    for name, param in oracle.named_parameters():
        if param.grad is None:
            continue
        grad = grads.get(name)
        if grad is None:
            return float("inf")
        worst = max(worst, (grad - param.grad).abs().max().item() / scale)
    return worst


def _call(module, inputs):
    return module(**inputs) if isinstance(inputs, dict) else module(*inputs)


def measure(name: str, label: str, q: int, d: int, mode: str) -> Row:
    """One model on one mesh: see the module docstring."""
    row = Row(name, label)
    try:
        case = build(name)
        oracle = copy.deepcopy(case.model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sim = tess_compile.simulate(case.model, q, d, example_inputs=case.inputs, mode=mode)
        row.replicated = _replicated_ops(caught)
        out = _call(sim, case.inputs)
        case.loss(out).backward()
    except Exception as error:  # noqa: BLE001 - a table of what fails is the point
        row.failure = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return row
    expected = _call(oracle, case.inputs)
    case.loss(expected).backward()
    row.error = _relative_error(sim, oracle, out, expected, case.loss)
    flops, row.compute_dtype = _model_facts(name)
    row.redundant = redundant_work(sim.program, flops)
    return row


@functools.cache
def _model_facts(name: str) -> tuple[int, torch.dtype]:
    """The unsharded model's forward FLOPs, and the dtype it computes in: float64, or the
    least precise dtype its own graph casts a float64 value down to (one capture, shared
    by every mesh)."""
    case = build(name)
    args, kwargs = split_example_inputs(case.inputs)
    gm = capture(case.model, args, kwargs)
    dtypes = {torch.float64} | {_cast_down(node) for node in gm.graph.nodes} - {None}
    return captured_forward_flops(gm), max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)


def _cast_down(node) -> torch.dtype | None:
    """The dtype of `node`'s value if it is floating and less precise than one of its
    floating inputs (a cast such as `.to(torch.float32)` of a float64 value)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return None
    inputs = [arg.meta.get("val") for arg in node.all_input_nodes]
    finer = [v for v in inputs if isinstance(v, torch.Tensor) and v.is_floating_point()
             and torch.finfo(v.dtype).eps < torch.finfo(val.dtype).eps]
    return val.dtype if finer else None


def _replicated_ops(caught) -> list[str]:
    """`op xN` of each op that runs replicated, from the compiler's one warning."""
    ops: dict[str, int] = {}
    for warning in caught:
        for line in str(warning.message).splitlines()[1:] if "run replicated" in str(warning.message) else []:
            op, count = line.split()[:2]
            ops[op] = ops.get(op, 0) + int(count[1:])
    return [f"{op.removeprefix('aten.')} x{n}" for op, n in sorted(ops.items())]


def _format(rows: list[Row], markdown: bool) -> str:
    lines = ["| model | mesh | max error | computes in | redundant work | replicated ops / failure |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        if row.failure:
            lines.append(f"| {row.name} | {row.mesh} | - | - | - | {row.failure} |")
            continue
        redundant = "-" if row.redundant is None else f"{row.redundant:.2f}"
        dtype = str(row.compute_dtype).removeprefix("torch.")
        lines.append(f"| {row.name} | {row.mesh} | {row.error:.1e} | {dtype} | {redundant} | {', '.join(row.replicated)} |")
    return "\n".join(lines) if markdown else "\n".join(line.strip("|") for line in lines if "---" not in line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(ARCHITECTURES))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        for label, q, d, mode in MESHES:
            rows.append(measure(name, label, q, d, mode))
            print(_format(rows[-1:], markdown=True).splitlines()[-1], flush=True)
    print(_format(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
