"""Coverage of real architectures: exactness and redundant work, per call and mesh.

For every model of `benchmarks/architectures.py`, every call its users make
(`architectures.calls`: the default call, with labels, with a padded
attention_mask, at the config's defaults in train and in eval mode) and each
mesh of `MESHES` that call runs on (`CALLS`), the model is simulated in
float64, and one forward and backward is compared with the unsharded model's,
both run after `torch.manual_seed(SEED)` (dropout draws the same masks):

- `error`: the largest difference of the loss and of any parameter's full
  gradient, relative to the largest gradient of the model (some gradients
  are mathematically zero, so each is measured on the model's scale); the
  eval call runs under `torch.no_grad()`, as a validation loop does, and
  compares the loss and the logits (relative to the largest logit);
- `own loss`: with labels, the same for the model's own `.loss` (transformers'
  causal-LM losses ask for float32 logits, which stay float64 here);
- `redundant`: forward FLOPs over all ranks over the unsharded model's
  (`tess_compile.analysis.accounting.redundant_work`; 1.00: no rank repeats another's
  matmul-like work);
- `replicated`: the ops with no sharding rule (they run whole on every rank);
- `computes in`: float64, or the least precise dtype the model's own graph
  casts a float64 value down to. Both runs keep float64 through the model's
  own casts down (`tess_compile.keep_float64`: Llama's RMSNorm, rotary tables
  and transformers' losses ask for float32), as `check` does, so every model
  here computes in float64 and is compared at 1e-12.

A case that does not compile or run gets its error's first line instead.

    python3 benchmarks/coverage.py [--models gpt2 bert ...] [--calls default labels ...] [--markdown]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile  # noqa: E402
from benchmarks.architectures import ARCHITECTURES, build, calls  # noqa: E402
from tess_compile.analysis.accounting import redundant_work  # noqa: E402
from tess_compile.keep_float64 import keeping_float64  # noqa: E402
from tess_compile.validation import captured_facts  # noqa: E402

__all__ = ["CALLS", "MESHES", "SEED", "Row", "cases", "main", "measure"]

# (label, q, d, mode)
MESHES = [("2.5d [2,2,2]", 2, 2, "2.5d"), ("1d p=4", 2, 1, "1d")]
# call -> the labels of the meshes it runs on (docs/coverage.md, "Calls"): the default call and
# labels on both; padding, dropout and eval where the batch is split over depth and row; one sequence
# (tokens) where its tokens split over depth and row (context parallelism; 1-D p=4 splits the tokens of
# the other calls over col already: sequence parallelism)
CALLS = {"default": ["2.5d [2,2,2]", "1d p=4"], "labels": ["2.5d [2,2,2]", "1d p=4"], "padded": ["2.5d [2,2,2]"],
         "train": ["2.5d [2,2,2]"], "eval": ["2.5d [2,2,2]"], "tokens": ["2.5d [2,2,2]"]}
SEED = 0  # torch's seed before the sharded and the unsharded run


@dataclass
class Row:
    name: str
    call: str
    mesh: str
    error: float | None = None
    own_loss_error: float | None = None
    own_loss_dtype: torch.dtype | None = None
    redundant: float | None = None
    replicated: list[str] = field(default_factory=list)
    failure: str | None = None
    compute_dtype: torch.dtype | None = None


def cases(names=None, call_names=None) -> list[tuple[str, str, str, int, int, str]]:
    """`(name, call, label, q, d, mode)` of every model of `names` (all), every call of
    `call_names` (all) that it makes, on each mesh that `CALLS` gives the call."""
    return [(name, call, *mesh) for name in names or ARCHITECTURES for call in calls(name)
            if call in (call_names or CALLS) for mesh in MESHES if mesh[0] in CALLS[call]]


def _call(module, inputs):
    return module(**inputs) if isinstance(inputs, dict) else module(*inputs)


def _run(module, case, grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits (or output) of `module` on the case's inputs and its losses: the zoo's, then the
    model's own (`.loss`) where the case compares it; after `torch.manual_seed(SEED)`."""
    torch.manual_seed(SEED)
    with torch.set_grad_enabled(grad):
        out = _call(module, case.inputs)
        losses = [case.loss(out), out.loss] if case.own_loss else [case.loss(out)]
    return getattr(out, "logits", out), losses


def _compare(sim, oracle, got, expected, retain_graph: bool = False) -> float:
    """The difference of loss `got` from `expected` relative to it, and after the backward of
    both, of each full gradient relative to the model's largest gradient."""
    errors = [_relative(got, expected)]
    if not expected.requires_grad:
        return errors[0]
    for module in (sim, oracle):
        module.zero_grad(set_to_none=False)
    got.backward(retain_graph=retain_graph)
    expected.backward(retain_graph=retain_graph)
    scale = max(p.grad.abs().max().item() for p in oracle.parameters() if p.grad is not None)
    grads = sim.full_grads()
    for name, param in oracle.named_parameters():
        if param.grad is not None:
            grad = grads.get(name)
            errors.append(math.inf if grad is None else (grad - param.grad).abs().max().item() / scale)
    return _worst(errors)


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| over max |expected|."""
    return (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-300)


def _worst(errors: list[float]) -> float:
    """The largest error; NaN if any is (`max` would skip a NaN after the first item)."""
    return math.nan if any(math.isnan(error) for error in errors) else max(errors)


def measure(name: str, call: str, label: str, q: int, d: int, mode: str) -> Row:
    """`name` called as `call` on one mesh: see the module docstring."""
    row = Row(name, call, label)
    try:
        case = build(name, call)
        oracle = copy.deepcopy(case.model)
        with keeping_float64(case.model, oracle):
            with warnings.catch_warnings(record=True) as caught, captured_facts() as facts:
                warnings.simplefilter("always")
                sim = tess_compile.simulate(case.model, q, d, example_inputs=case.inputs, mode=mode)
            row.replicated = _replicated_ops(caught)
            (logits, got), (expected_logits, expected) = (_run(m, case, grad=call != "eval") for m in (sim, oracle))
        row.error = _compare(sim, oracle, got[0], expected[0], retain_graph=case.own_loss)
        if call == "eval":  # no gradients: the whole output too
            row.error = _worst([row.error, _relative(logits, expected_logits)])
        if case.own_loss:
            row.own_loss_error, row.own_loss_dtype = _compare(sim, oracle, got[1], expected[1]), expected[1].dtype
        flops, row.compute_dtype = facts[0]
        row.redundant = redundant_work(sim.program, flops)
    except Exception as error:  # noqa: BLE001 - a table of what fails is the point
        row.failure = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return row


def _replicated_ops(caught) -> list[str]:
    """`op xN` of each op that runs replicated, from the compiler's one warning."""
    ops: dict[str, int] = {}
    for warning in caught:
        for line in str(warning.message).splitlines()[1:] if "run replicated" in str(warning.message) else []:
            op, count = line.split()[:2]
            ops[op] = ops.get(op, 0) + int(count[1:])
    return [f"{op.removeprefix('aten.')} x{n}" for op, n in sorted(ops.items())]


def _format(rows: list[Row], markdown: bool) -> str:
    lines = ["| model | call | mesh | max error | own loss | computes in | redundant work | replicated ops / failure |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.failure:
            lines.append(f"| {row.name} | {row.call} | {row.mesh} | - | - | - | - | {row.failure} |")
            continue
        own = "-" if row.own_loss_error is None else f"{row.own_loss_error:.1e} ({_dtype(row.own_loss_dtype)})"
        redundant = "-" if row.redundant is None else f"{row.redundant:.2f}"
        lines.append(f"| {row.name} | {row.call} | {row.mesh} | {row.error:.1e} | {own} | {_dtype(row.compute_dtype)} "
                     f"| {redundant} | {', '.join(row.replicated)} |")
    return "\n".join(lines) if markdown else "\n".join(line.strip("|") for line in lines if "---" not in line)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(ARCHITECTURES))
    parser.add_argument("--calls", nargs="*", default=list(CALLS))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: spare threads only spin
    rows = []
    for case in cases(args.models, args.calls):
        rows.append(measure(*case))
        print(_format(rows[-1:], markdown=True).splitlines()[-1], flush=True)
    print(_format(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
