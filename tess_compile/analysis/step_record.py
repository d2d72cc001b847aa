"""One fake training step of a compiled program, recorded: the bytes rank 0 holds after each op, the
kernels of forward and backward, and the bytes autograd saves in forward, from the one step
(`record_step`, cached per program graph and tail: `recorded`, `short_record`).

The step runs on fake tensors under torch's `MemTracker` without its module hooks (`step_tracker`),
each op labelled by the node (or the parameter) it runs for, so that `tess_compile.analysis.memory`
prices a step's peak and its working and update parts from it, `tess_compile.analysis.cost_model`
its kernels, and `tess_compile.analysis.block_reuse` extends a short program's to the whole one.
The tail around the program's call (`tess_compile.analysis.step_tail`) runs in the step, but its
gather's and loss's kernels and saved tensors are not recorded: `step_tail.tail_time` prices them.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Interpreter
from torch.optim.optimizer import _get_scalar_dtype

from tess_compile.analysis.kernels import KernelRecorder, PhaseProfile
from tess_compile.analysis.step_tail import README_STEP, StepTail, tail_tops
from tess_compile.core.fake_run import placeholder_values, tensor_leaves
from tess_compile.core.meta_keys import ROLE, WEIGHT_INPUT
from tess_compile.core.program import Program
from tess_compile.ops.collectives import ShapeComm, use_comm

__all__ = ["StepRecord", "fake_training_step", "is_weight", "record_step", "recorded", "short_record",
           "step_tracker"]


def is_weight(node) -> bool:
    """A placeholder of a parameter, a tied parameter's second name, or a weight given as an input."""
    if node.op != "placeholder":
        return False
    return ROLE.of(node)[0] in ("param", "alias") or WEIGHT_INPUT.has(node)



def step_tracker():
    """torch's `MemTracker` without its module hooks: a new one, to use as MemTracker is used.

    MemTracker's module tracker hooks the inputs of every module called in the step, which are, in a
    per-rank program, its recompute regions (`tess_compile.ops.recompute_region`), and holds the
    gradients of a module's inputs until the last of them arrives (`register_multi_grad_hook`): a
    region's weights' gradients until its last input's, a norm weight's that the gradient bucket sums
    at the end of backward, as no run holds them. Without module hooks it counts what the step
    holds: the program's own tensors, autograd's, the recompute regions' and the optimizer's."""
    return _step_tracker_class()()


@functools.cache
def _step_tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker  # imports torch.distributed's tools: only when asked
    from torch.distributed._tools.mod_tracker import ModTracker

    class NoModules(ModTracker):
        """A module tracker that hooks no module."""

        def __enter__(self):
            return self

        def __exit__(self, *args):
            pass

    class StepTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._mod_tracker = NoModules()

    return StepTracker



@dataclass(frozen=True)
class StepRecord:
    """What one fake training step of a program shows (`record_step`): the bytes held after each op with
    the op's label, the kernels of each phase (`tess_compile.analysis.kernels`) and the bytes autograd
    saved in forward (`activation_bytes`)."""

    moments: list[tuple[object, int]]
    phases: dict[str, PhaseProfile]
    saved: int
    static: list[int] = dataclasses.field(default_factory=list)  # each moment's parameters, gradients, AdamW state
    updating: list[bool] = dataclasses.field(default_factory=list)  # whether each moment is the optimizer's step


# per-rank graph (a whole program's or a short form's) -> {tail: its StepRecord}
_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def short_record(program: Program, short: Program, tail: StepTail = README_STEP) -> StepRecord:
    """`record_step` of `short`, a short form of the program compiled with block reuse `program`
    (`Repeats.short`), its nodes labelled by their blocks. Its kernels and saved bytes are the
    program's whatever the tail's gather and loss: the analyses that read only those share README's
    record."""
    return recorded(short, tail, lambda: program.repeats.labels(short))


def recorded(program: Program, tail: StepTail, node_labels: Callable[[], dict]) -> StepRecord:
    """`record_step(program, node_labels(), tail)`, run once per program graph and tail (`node_labels()`
    only when it runs)."""
    records = _RECORDS.setdefault(program.graph, {})
    if tail not in records:
        records[tail] = record_step(program, node_labels(), tail)
    return records[tail]


def record_step(program: Program, node_labels: dict, tail: StepTail = README_STEP) -> StepRecord:
    """One fake training step of `program` as `step_peak`'s second one runs it (the one whose peak is the
    higher: the AdamW state exists from its start), recording the bytes rank 0 holds after each op with
    the label of the op (`node_labels` of the program's graph nodes: an op of forward by its node, of
    backward by the node whose backward runs it, of the optimizer by the parameter it updates; an op of
    none takes the label before), the kernels of forward and backward (`KernelRecorder`), and the
    storages autograd saves in the program's forward, the weights' left out (`activation_bytes`), with
    `tail` around the program's call: the kernels and saved tensors of the tail's gather and loss are not
    recorded (`step_tail.tail_time` prices them), so the program's are the same under any of them (with
    `zero_grad` to zeros, backward adds into each kept gradient)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    labels = _Labels(program, node_labels)

    class Tracker(_step_tracker_class()):
        def __init__(self):
            super().__init__()
            self.moments: list[tuple[object, int]] = []
            self.static: list[int] = []
            self.updating: list[bool] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            labels.before(args, kwargs)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            labels.after(out)
            if not labels.in_tail():  # the program's kernels: the tail's backward ops left out
                kernels.record(func, args, kwargs or {}, out)
            return out

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            self.moments.append((labels.current, sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())))
            self.static.append(grads.held + state_bytes)
            self.updating.append(labels.phase == "optimizer")

    graph = program.runnable
    saved: dict[int, int] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        values = placeholder_values(graph, program.mesh)
        labels.placeholders(values)
        weights = {v.untyped_storage()._cdata for v, n in zip(values, graph.graph.find_nodes(op="placeholder"))
                   if is_weight(n) and isinstance(v, torch.Tensor)}

        def pack(tensor):
            if labels.phase == "forward" and tensor.untyped_storage()._cdata not in weights:
                saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
            return tensor

        params = [v for v in tensor_leaves(values) if v.requires_grad] if program.training else []
        optimizer = torch.optim.AdamW(params) if params else None
        if optimizer is not None:  # the state of a first step
            for param in params:
                param.grad = torch.zeros_like(param)
            _first_step(optimizer)
            optimizer.zero_grad(set_to_none=tail.set_to_none)
        state_bytes = _storage_bytes([*params, *(t for p in params for t in (optimizer.state[p].values()
                                                                            if optimizer else ()))])
        grads = _GradientBytes(params)
        tracker, kernels = Tracker(), KernelRecorder()  # the tracker records the kernels too: one mode
        kept = [p.grad for p in params if p.grad is not None]  # zero_grad(set_to_none=False)'s, held throughout
        tracker.track_external(*tensor_leaves(values), *kept, *([optimizer] if optimizer else []))
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fake_training_step(program, values, optimizer, tail, labels, kernels)
    phases = {phase: PhaseProfile(**totals) for phase, totals in kernels.totals.items()}
    return StepRecord(tracker.moments, phases, sum(saved.values()), tracker.static, tracker.updating)


def _first_step(optimizer: torch.optim.Optimizer) -> None:
    """The state `optimizer.step()` leaves after a first step: of AdamW in its default options, made as its
    step makes it (`Adam._init_group`: each parameter's step count, here 1, and its two moments) without
    running the step's dozen ops a parameter; other options run the step."""
    groups = optimizer.param_groups
    if not isinstance(optimizer, torch.optim.Adam) or any(
            group[option] for group in groups for option in ("amsgrad", "fused", "capturable", "differentiable")):
        optimizer.step()
        return
    for param in (param for group in groups for param in group["params"] if param.grad is not None):
        optimizer.state[param] = {"step": torch.tensor(1.0, dtype=_get_scalar_dtype()),
                                  "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


class _GradientBytes:
    """The bytes of the parameters' gradients (`held`), summed again only after autograd has accumulated into
    one: a step's ops outnumber its parameters by far, and only backward's AccumulateGrad changes a gradient
    (AdamW reads them; `zero_grad` runs after the last op recorded, or zeroes them in place)."""

    def __init__(self, params: list[torch.Tensor]):
        self._params = params
        self._held = _storage_bytes(p.grad for p in params)
        self._changed = False
        for param in params:
            param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param: torch.Tensor) -> None:
        self._changed = True

    @property
    def held(self) -> int:
        if self._changed:
            self._held, self._changed = _storage_bytes(p.grad for p in self._params), False
        return self._held


def _storage_bytes(tensors) -> int:
    """Bytes of the storages of `tensors` (None and scalars left out), each storage once."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor) and t.dim()}
    return sum(storages.values())


class _Labels:
    """The label of the op running now, for `record_step` (see there)."""

    def __init__(self, program: Program, node_labels: dict):
        by_name = {node.name: label for node, label in node_labels.items()}
        self.of_node = {}
        for node in program.runnable.graph.nodes:
            name = node.name
            if node.op == "call_module":  # a recompute region: its first op's block
                inner = program.runnable.get_submodule(node.target).graph_module.graph
                name = next(n.name for n in inner.nodes if n.op == "call_function")
            self.of_node[node] = by_name.get(name)
        self.current = None
        self.phase = "forward"  # then "tail" (the tail's forward), "backward", "optimizer"
        self.forward_end = None  # the autograd sequence number after the program's forward: the tail's nodes from it
        self.starts: list[int] = []  # the first autograd sequence number of each node run in forward
        self.start_labels: list[object] = []
        self.of_storage: dict[int, object] = {}  # optimizer: storages of parameters, gradients and state

    def in_tail(self) -> bool:
        """Whether the op running now in backward is the tail's: outside every autograd node (the loss's
        seed), or in one the tail's forward made."""
        if self.phase != "backward":
            return False
        node = torch._C._current_autograd_node()
        return node is None or (not hasattr(node, "variable") and node._sequence_nr() >= self.forward_end)

    def placeholders(self, values: list) -> None:
        nodes = self.placeholder_nodes = [n for n in self.of_node if n.op == "placeholder"]
        self.of_tensor = {id(v): self.of_node[n] for n, v in zip(nodes, values)}

    def run(self, node) -> None:
        self.current = self.of_node.get(node)
        self.starts.append(torch._C._autograd._get_sequence_nr())
        self.start_labels.append(self.current)

    def before(self, args, kwargs) -> None:
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None and hasattr(node, "variable"):  # AccumulateGrad: the parameter's block
                self.current = self.of_tensor.get(id(node.variable), self.current)
            elif node is not None and self.starts and node._sequence_nr() >= self.starts[0]:
                index = bisect.bisect_right(self.starts, node._sequence_nr()) - 1
                self.current = self.start_labels[index]
        elif self.phase == "optimizer":  # by the parameter, gradient or state it reads (not a step count)
            for t in tensor_leaves(args, kwargs):
                if t.dim() and t.untyped_storage()._cdata in self.of_storage:
                    self.current = self.of_storage[t.untyped_storage()._cdata]
                    break

    def after(self, out) -> None:
        if self.phase == "optimizer":
            for t in tensor_leaves(out):
                if t.dim():  # a storage's address is another's once it is freed: the newest holder's
                    self.of_storage[t.untyped_storage()._cdata] = self.current

    def optimizer(self, optimizer) -> None:
        self.phase = "optimizer"
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            for t in (p, p.grad, *optimizer.state.get(p, {}).values()):
                if isinstance(t, torch.Tensor) and t.dim():
                    self.of_storage[t.untyped_storage()._cdata] = self.of_tensor.get(id(p))


class _LabelledRun(Interpreter):
    def __init__(self, gm, labels: _Labels):
        super().__init__(gm)
        self.labels = labels

    def run_node(self, node):
        self.labels.run(node)
        return super().run_node(node)


def fake_training_step(program: Program, values: list, optimizer, tail: StepTail, labels: _Labels | None = None,
                        kernels: KernelRecorder | None = None) -> None:
    """A training step of `program` on the fake `values` with `tail` around its call (see `step_peak`);
    `labels` and `kernels`, if given, follow its phases (`record_step`; the tail's forward left out)."""
    graph = program.runnable
    with use_comm(ShapeComm()), torch.set_grad_enabled(optimizer is not None):
        _phase(labels, kernels, "forward")
        outputs = graph.forward(*values) if labels is None else _LabelledRun(graph, labels).run(*values)
        _phase(labels, kernels, "tail")
        roots, tops, seeds = tail_tops(program, outputs, tail)
        del outputs
        if roots:
            _phase(labels, kernels, "backward")
            with use_comm(ShapeComm(), "backward"):
                torch.autograd.backward(tops, seeds)
        del roots, tops, seeds
    if optimizer is not None:
        _phase(labels, kernels, "optimizer")
        if labels is not None:
            labels.optimizer(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=tail.set_to_none)


def _phase(labels: _Labels | None, kernels: KernelRecorder | None, phase: str) -> None:
    """Enter `phase` ("forward", "tail", "backward", "optimizer"); the kernels recorded are forward's and backward's."""
    if labels is not None:
        if phase == "tail":
            labels.forward_end = torch._C._autograd._get_sequence_nr()
        labels.phase = phase
    if kernels is not None:
        kernels.phase = phase if phase in ("forward", "backward") else None
