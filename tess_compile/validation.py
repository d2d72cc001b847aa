"""Translation validation of the user's own model: `check` compares every simulated rank with the model.

The face, beside `backend.py`. `check` makes a float64 copy of the model and
of its inputs (the user's own stay as they are), compiles it for the mesh,
runs every rank in this process (as `tess_compile.simulate` does) and the
unsharded copy beside it, and compares: every output, a loss, every
parameter's gradient, and every rank's block of every parameter and buffer
after one optimizer step. It also reports the forward FLOPs over all ranks
over the unsharded model's (`tess_compile.analysis.accounting.redundant_work`)
and the ops that run replicated, as the compiled program marks them. The
result is a `CheckReport`; docs/check.md says how to read its table.

Errors are relative: an output to its own largest element, the loss to
itself, a gradient to the model's largest gradient, a parameter after the
step to the model's largest parameter, a buffer to its own largest element.
The tolerance is 1e-12 in float64. Both copies run their forward under
`tess_compile.keep_float64` (the model's own casts to float32, as in Llama's
RMSNorm, keep float64; the report lists them); a model whose graph still
casts a float64 value down (`compute_dtype`) has that dtype's rounding as its
floor (float32: 1e-5). A cache the sharded module does not return (transformers'
DynamicCache under use_cache=True) is reported as not compared.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree
from tqdm import tqdm

from tess_compile.passes.capture import is_cache
from tess_compile.passes.observers import PassResult, add_pass_observer, remove_pass_observer
from tess_compile.analysis.accounting import captured_forward_flops, redundant_work
from tess_compile.analysis.compile_entry import compile_for
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import GLOBAL_NODE, REPLICATED
from tess_compile.core.options import CompileOptions, takes_compile_options
from tess_compile.core.program import Program, split_example_inputs
from tess_compile.keep_float64 import keeping_float64
from tess_compile.runtime.simulator import SimulatedModule

__all__ = [
    "CheckMismatch",
    "CheckReport",
    "SEED",
    "TOLERANCES",
    "captured_facts",
    "check",
    "compare_outputs",
    "compute_dtype",
    "replicated_ops",
    "tolerance_for",
]

# The tolerance of each dtype a model computes in; another floating dtype: 10 of its epsilons.
TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5}
SEED = 0  # torch's seed before each run (dropout draws alike) and the random projection's
NUM_WORST = 3  # tensors named per row of the table
STAGES = ("compile", "sharded run", "unsharded run", "compare", "optimizer step")


class CheckMismatch(ValueError):
    """`check(..., strict=True)` found a mismatch; `report` is the whole `CheckReport`."""

    def __init__(self, message: str, report: CheckReport):
        super().__init__(message)
        self.report = report


@dataclass
class CheckReport:
    """What `check` measured: relative errors by tensor name (see the module docstring), the
    loss, redundant work and the ops that run replicated. `ok`: every error within `tolerance`."""

    mesh: Mesh
    compute_dtype: torch.dtype
    tolerance: float
    outputs: dict[str, float]
    loss: float
    loss_source: str
    loss_values: tuple[float, float]  # (sharded, unsharded)
    gradients: dict[str, float]
    weights: dict[str, float]  # parameters and buffers after the step, worst rank of each
    optimizer: str
    redundant_work: float | None  # forward FLOPs over all ranks / unsharded; None: no matmul-like FLOPs
    replicated_ops: list[str]  # "op xN at file:line"
    not_compared: dict[str, str]  # output name -> why (a cache the sharded module does not return)
    kept_float64: list[str]  # the model's casts down that ran in float64: "what at file:line"

    @property
    def checks(self) -> dict[str, dict[str, float]]:
        """`{check: {tensor name: error}}`, in the order a wrong value propagates: outputs, loss,
        gradients, weights after the step (names say which check they belong to)."""
        return {
            "outputs": {f"output {name}": e for name, e in self.outputs.items()},
            "loss": {"loss": self.loss},
            "gradients": {f"gradient of {name}": e for name, e in self.gradients.items()},
            "weights after the step": {f"{name} after the step": e for name, e in self.weights.items()},
        }

    @property
    def ok(self) -> bool:
        """Whether every error is within the tolerance (NaN is not)."""
        return not any(_fails(error, self.tolerance) for errors in self.checks.values() for error in errors.values())

    def worst(self) -> tuple[str, float]:
        """The name and error of the tensor that differs most (a missing one: inf) in the first
        check that fails (a wrong gradient makes the weights after the step wrong too), or in all."""
        failing = [errors for errors in self.checks.values() if any(_fails(e, self.tolerance) for e in errors.values())]
        errors = failing[0] if failing else {k: e for errors in self.checks.values() for k, e in errors.items()}
        return max(errors.items(), key=lambda item: _order(item[1]))

    @property
    def mismatch(self) -> str | None:
        """A line naming the worst tensor and its error if it is over the tolerance, else None."""
        if self.ok:
            return None
        name, error = self.worst()
        return f"{name} differs from the unsharded model's by {_error(error)} (relative), over {self.tolerance:g}"

    def table(self) -> str:
        """The report as a table: a header with the mesh and tolerance, then one row per check."""
        skipped = "".join(f"; not compared: {name}, {why}" for name, why in self.not_compared.items())
        rows = [
            ("outputs", _largest(self.outputs), _worst_names(self.outputs, "tensor") + skipped),
            ("loss", self.loss, f"{self.loss_source}: {self.loss_values[0]:.10g} sharded, "
                                f"{self.loss_values[1]:.10g} unsharded"),
            ("gradients", _largest(self.gradients), _worst_names(self.gradients, "parameter")),
            ("weights after the step", _largest(self.weights),
             f"{self.optimizer}, every rank's block; " + _worst_names(self.weights, "tensor")),
        ]
        lines = [_header(self), f"{'check':<24}{'rel. error':>11}  {'result':<10}details"]
        for name, error, details in rows:
            verdict = "MISMATCH" if _fails(error, self.tolerance) else "ok"
            lines.append(f"{name:<24}{_error(error):>11}  {verdict:<10}{details}")
        redundant = "-" if self.redundant_work is None else f"{self.redundant_work:.2f}"
        lines.append(f"{'redundant work':<24}{redundant:>11}  {'':<10}forward FLOPs over all ranks / unsharded")
        lines.append(f"{'replicated ops':<24}{len(self.replicated_ops):>11}  {'':<10}"
                     + ("; ".join(self.replicated_ops) or "none (every op has a sharding rule)"))
        lines.append("result: OK" if self.ok else f"result: MISMATCH: {self.mismatch}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _header(report: CheckReport) -> str:
    mesh = report.mesh
    dtype = str(report.compute_dtype).removeprefix("torch.")
    why = "" if report.compute_dtype == torch.float64 else f" (its code casts float64 down to {dtype})"
    lines = [f"tess-compile check: mesh {mesh}, mode {mesh.mode}, {mesh.num_ranks} ranks simulated on float64 copies",
             f"the model computes in {dtype}{why}: tolerance {report.tolerance:g}"]
    if report.kept_float64:
        lines.append(f"kept float64 at the model's own casts to a less precise dtype ({len(report.kept_float64)}): "
                     + ", ".join(_short(cast) for cast in report.kept_float64))
    return "\n".join(lines)


def _short(cast: str) -> str:
    """"what at file:line" with the file's base name."""
    what, _, where = cast.rpartition(" at ")
    return f"{what} at {os.path.basename(where)}"


def _fails(error: float, tolerance: float) -> bool:
    return not error <= tolerance  # NaN fails


def _order(error: float) -> float:
    return math.inf if math.isnan(error) else error


def _error(error: float) -> str:
    return f"{error:.1e}" if math.isfinite(error) else str(error)


def _largest(errors: dict[str, float]) -> float:
    return max(errors.values(), key=_order, default=0.0)


def _worst_names(errors: dict[str, float], what: str) -> str:
    """"N tensors; worst: a 1e-16, b 9e-17, c 0" with the NUM_WORST worst."""
    worst = sorted(errors.items(), key=lambda item: -_order(item[1]))[:NUM_WORST]
    names = ", ".join(f"{name} {'missing' if error == math.inf else _error(error)}" for name, error in worst)
    return f"{len(errors)} {what}{'s' if len(errors) != 1 else ''}; worst: {names or '-'}"


def tolerance_for(dtype: torch.dtype) -> float:
    """The relative error a model that computes in `dtype` may show (`TOLERANCES`)."""
    return TOLERANCES.get(dtype, 10 * torch.finfo(dtype).eps)


def compute_dtype(gm: GraphModule) -> torch.dtype:
    """float64, or the least precise floating dtype that the captured graph `gm` casts a more
    precise floating value down to (Llama's RMSNorm `.to(torch.float32)`)."""
    dtypes = {torch.float64} | ({_cast_down(node) for node in gm.graph.nodes} - {None})
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)


def _cast_down(node: Node) -> torch.dtype | None:
    """The dtype of `node`'s value if it is floating and less precise than one of its
    floating inputs (a cast such as `.to(torch.float32)` of a float64 value)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return None
    inputs = [arg.meta.get("val") for arg in node.all_input_nodes]
    finer = [v for v in inputs if isinstance(v, torch.Tensor) and v.is_floating_point()
             and torch.finfo(v.dtype).eps < torch.finfo(val.dtype).eps]
    return val.dtype if finer else None


@takes_compile_options
def check(
    model: nn.Module,
    q: int,
    d: int,
    *,
    example_inputs,
    options: CompileOptions | None = None,
    loss_fn: Callable[[object], torch.Tensor] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    tolerance: float | None = None,
    cluster: Cluster | str | os.PathLike | None = None,
    progress: bool = True,
) -> CheckReport:
    """Check that `model` sharded on the `[q, q, d]` mesh computes what it computes unsharded.

    On float64 copies of `model` and `example_inputs` (both left as they are),
    every rank is simulated in this process and compared with the unsharded
    copy: every output, the loss, every parameter's gradient, and every rank's
    block of each parameter and buffer after one step of `optimizer(params)`
    (default `torch.optim.SGD(params, lr=1.0)`: AdamW would amplify the rounding
    of a gradient that is mathematically zero). The loss is `loss_fn(output)`,
    else the output's `.loss` (a Hugging Face model fed labels), else the
    output if it is a scalar, else a fixed random projection of the floating
    outputs. Both copies keep float64 through the model's own casts down
    (`tess_compile.keep_float64`). The compile options are those of `CompileOptions`; `strict=True`
    also raises a `CheckMismatch` (a ValueError naming the worst tensor) on a
    mismatch. `tolerance` overrides the dtype's (`tolerance_for`). Progress goes
    to stderr when it is a terminal and `progress` is true. Returns a `CheckReport`.
    """
    mesh = options.mesh(q, d)
    model64, inputs = _float64_copies(model, example_inputs)
    oracle = copy.deepcopy(model64)
    bar = tqdm(total=len(STAGES), desc="tess-compile check", file=sys.stderr, leave=False, ascii=True,
               bar_format="{desc} [{bar:20}] {n_fmt}/{total_fmt} stages, {elapsed}",
               disable=not (progress and sys.stderr.isatty()))
    with bar, torch.random.fork_rng(devices=[]), keeping_float64(model64, oracle) as kept:
        with _stage(bar, "compile"), captured_facts() as facts:
            program = compile_for(model64, mesh, inputs, options, cluster).program
            sim = SimulatedModule(program)
        flops, dtype = facts[0]
        with _stage(bar, "sharded run"):
            out, loss, loss_source = _run(sim, inputs, loss_fn)
        with _stage(bar, "unsharded run"):
            expected, expected_loss, _ = _run(oracle, inputs, loss_fn)
        with _stage(bar, "compare"):
            outputs, not_compared = compare_outputs(out, expected)
            gradients = _compare_gradients(sim.full_grads(), oracle)
        with _stage(bar, "optimizer step"):
            weights, optimizer_name = _step_and_compare(sim, oracle, optimizer)
    report = CheckReport(
        mesh=mesh, compute_dtype=dtype, tolerance=tolerance_for(dtype) if tolerance is None else tolerance,
        outputs=outputs, loss=_relative(loss, expected_loss, _scale(expected_loss)), loss_source=loss_source,
        loss_values=(loss.item(), expected_loss.item()), gradients=gradients, weights=weights,
        optimizer=optimizer_name, redundant_work=redundant_work(program, flops),
        replicated_ops=replicated_ops(program), not_compared=not_compared, kept_float64=list(kept.kept),
    )
    if options.strict and not report.ok:
        raise CheckMismatch(f"tess_compile.check: {report.mismatch} on mesh {mesh}: a sharding rule computes it "
                            "otherwise than the model does; report the table below as a bug, and meanwhile try "
                            f"another mode= or summa= (strict=False returns the report)\n{report.table()}", report)
    return report


@contextlib.contextmanager
def captured_facts():
    """A list that gets `(forward FLOPs, compute dtype)` of each graph that a compile in the block
    captures: the unsharded model's facts from the compile's own capture, not a capture of its own."""
    facts: list[tuple[int, torch.dtype]] = []

    def observe(result: PassResult) -> None:
        if result.name == "capture":
            facts.append((captured_forward_flops(result.graph), compute_dtype(result.graph)))

    add_pass_observer(observe)
    try:
        yield facts
    finally:
        remove_pass_observer(observe)


@contextlib.contextmanager
def _stage(bar: tqdm, name: str):
    bar.set_description_str(f"tess-compile check: {name}")
    yield
    bar.update()


def _float64_copies(model: nn.Module, example_inputs) -> tuple[nn.Module, object]:
    """A float64 deep copy of `model` without gradients, and `example_inputs` with every
    floating tensor cast to float64 (every tensor a copy)."""
    meta = next((name for name, t in model.state_dict().items() if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"tess_compile.check: {meta} of the model is on the meta device, so there is nothing to "
                         "compute: build a small config of the model with real (random) weights")
    model64 = copy.deepcopy(model).double()
    for param in model64.parameters():
        param.grad = None
    cast = (lambda t: t.detach().to(torch.float64, copy=True) if t.is_floating_point() else t.detach().clone())
    return model64, pytree.tree_map_only(torch.Tensor, cast, example_inputs)


def _run(module: nn.Module, inputs, loss_fn) -> tuple[object, torch.Tensor, str]:
    """`module`'s output on `inputs` (torch seeded with SEED first), its loss after backward,
    and where the loss came from."""
    args, kwargs = split_example_inputs(inputs)
    torch.manual_seed(SEED)
    out = module(*args, **kwargs)
    loss, source = _loss(out, loss_fn)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise ValueError(f"tess_compile.check: the loss ({source}) is {_describe(loss)}, not a floating scalar: "
                         "pass loss_fn=output -> scalar tensor")
    if not loss.requires_grad:
        raise ValueError(f"tess_compile.check: the loss ({source}) does not depend on any parameter (no grad_fn): "
                         "run the model with gradients on, or pass a loss_fn of its outputs")
    loss.backward()
    return out, loss.detach().reshape(()), source


def _loss(out, loss_fn) -> tuple[torch.Tensor, str]:
    if loss_fn is not None:
        return loss_fn(out), "loss_fn"
    if isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss, "the output's .loss"
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out, "the output (a scalar)"
    leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
    if not leaves:
        raise ValueError(f"tess_compile.check: the model returned {_describe(out)}, without a floating tensor to "
                         "build a loss from: pass loss_fn=output -> scalar tensor")
    generator = torch.Generator().manual_seed(SEED)
    weights = [torch.randn(leaf.shape, generator=generator, dtype=leaf.dtype).to(leaf.device) for leaf in leaves]
    return sum((leaf * w).sum() for leaf, w in zip(leaves, weights)), "a random projection of the outputs"


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def compare_outputs(out, expected) -> tuple[dict[str, float], dict[str, str]]:
    """`{output path: error}` of every tensor leaf of the unsharded output `expected`, each relative
    to its own largest element (one `out` lacks or adds: inf), and `{output path: why}` of the caches
    that the sharded module does not return (it is compiled without them: `capture`), not compared."""
    actual = {pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path(out, is_leaf=is_cache)[0]}
    errors, not_compared = {}, {}
    for path, leaf in pytree.tree_flatten_with_path(expected, is_leaf=is_cache)[0]:
        key, name = pytree.keystr(path), f"output{pytree.keystr(path)}"
        if is_cache(leaf) and actual.get(key) is None:
            not_compared[name] = (f"a {type(leaf).__name__} that the sharded module does not return (a training "
                                  "forward does not need the cache)")
        elif isinstance(leaf, torch.Tensor):
            errors[name] = _relative(actual.pop(key, None), leaf, _scale(leaf))
    errors.update({f"output{key}": math.inf for key, leaf in actual.items()
                   if isinstance(leaf, torch.Tensor) and f"output{key}" not in errors})
    return errors, not_compared


def _compare_gradients(grads: dict[str, torch.Tensor | None], oracle: nn.Module) -> dict[str, float]:
    """`{parameter: error}` of each full gradient, relative to the model's largest gradient
    (a gradient the unsharded model lacks counts as zeros; one only the sharded model lacks: inf)."""
    params = dict(oracle.named_parameters())
    scale = max((_scale(p.grad) for p in params.values() if p.grad is not None), default=0.0)
    errors = {}
    for name, param in params.items():
        actual = grads.get(name)
        if param.grad is None and actual is None:  # frozen, or not reached by the loss
            errors[name] = 0.0
            continue
        expected = param.grad if param.grad is not None else torch.zeros_like(param)
        errors[name] = _relative(actual, expected, scale)
    return errors


def _step_and_compare(sim: SimulatedModule, oracle: nn.Module, optimizer) -> tuple[dict[str, float], str]:
    """One step of `optimizer` (a factory of the parameters) on both models; `{name: error}` of
    every rank's block of every parameter and buffer (the worst rank), and the optimizer's name."""
    make = optimizer or (lambda params: torch.optim.SGD(params, lr=1.0))
    steps = [make(module.parameters()) for module in (sim, oracle)]
    for step in steps:
        step.step()
    state = {**dict(oracle.named_parameters()), **dict(oracle.named_buffers())}
    weight_scale = max((_scale(p) for p in oracle.parameters()), default=0.0)
    program = sim.program
    errors = {}
    for slot in program.slots:
        if slot.role not in ("param", "buffer") or slot.name not in state:
            continue
        full = state[slot.name].detach()
        scale = weight_scale if slot.role == "param" else _scale(full)
        errors[slot.name] = max(_relative(sim.rank_tensor(slot.name, rank), program.local_tensor(slot, rank, full),
                                          scale) for rank in range(program.mesh.num_ranks))
    lr = steps[1].param_groups[0].get("lr") if steps[1].param_groups else None
    return errors, type(steps[1]).__name__ + ("" if lr is None else f"(lr={float(lr):g})")


def _scale(tensor: torch.Tensor | None) -> float:
    """The largest magnitude in `tensor` (0 for an empty one)."""
    if tensor is None or tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return 0.0
    return tensor.detach().abs().max().item()


def _relative(actual: torch.Tensor | None, expected: torch.Tensor, scale: float) -> float:
    """max |actual - expected| over `scale` (equal values count 0, NaN as NaN included); an
    integer tensor 0 or inf; inf if `actual` is missing or of another shape."""
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        return math.inf
    actual, expected = actual.detach(), expected.detach().to(actual.device)
    if not (expected.is_floating_point() or expected.is_complex()):
        return 0.0 if torch.equal(actual, expected) else math.inf
    if expected.numel() == 0:
        return 0.0
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    difference = torch.where(same, 0.0, (actual - expected).abs()).max().item()
    return difference / max(scale, torch.finfo(torch.float64).tiny)


def replicated_ops(program: Program) -> list[str]:
    """"op xN at file:line" of each op of the model that runs replicated, in graph order, as the
    rewrite marks the per-rank node holding its value (`REPLICATED`: its source line)."""
    groups: dict[tuple[str, str], set[str]] = {}
    for node in program.graph.graph.nodes:
        if REPLICATED.has(node):
            key = (str(node.target).removeprefix("aten."), REPLICATED.of(node))
            groups.setdefault(key, set()).add(GLOBAL_NODE.get(node, node.name))
    return [f"{op} x{len(names)} at {line}" for (op, line), names in groups.items()]
