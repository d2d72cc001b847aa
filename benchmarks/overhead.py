"""Host overhead of the runtime: a world of one against the unsharded model, and each collective's
Python beyond its torch.distributed call.

A sharded program on a world of one process has no collective to run (every
mesh axis has size 1, and the rewrite emits no collective over an axis of
size 1), so whatever its step takes beyond the unsharded model's own step is
the runtime's: checking and flattening the inputs, the parameters' local
tensors and their gradients' DTensors, the per-rank FX graph, the output's
DTensor. Three sections, each one launch of `tess_compile.run_local`:

1. **A world of one** (one gloo process, one thread): a stack of `--layers`
   GPT blocks (`benchmarks.paper_tables.Block`: pre-LN, fused QKV, causal
   attention, GELU MLP) on a `[batch, seq, hidden]` input, fp32. A step is
   `zero_grad(set_to_none=True)`, forward, the mean square of the output
   (tess: of its local tensor, the whole output at a world of one) and
   backward; no optimizer step (AdamW over DTensors is torch's, the same with
   any runtime). Rows: the unsharded model eager and under `torch.compile`,
   `tess_compile.shard(model, 1, 1)` eager and with `compile=True`. Each row
   warms up (`--warmup` steps, compiles included), then `--rounds` rounds run
   `--steps` steps of every row in turn; a row's time is its median over
   rounds of the thread's CPU time per step (`time.thread_time`: the step is
   all host work on one thread, and other processes on the machine do not
   count). Columns: ms/step, the ratio to the unsharded eager and compiled
   steps, host microseconds per op (the step over the number of ops of the
   per-rank graph's forward, which at a world of one are the model's own
   ops), and the runtime's microseconds per op beyond the unsharded eager
   step. A last, reference row runs the tess program's per-rank graph alone,
   on plain leaf copies of its parameters: the step without the runtime
   around the graph (DTensor parameters and gradients, inputs, output). A line after the table gives
   the parameters' node alone (`dtensors.local_tensors`, which hands the graph the parameters' local
   tensors and puts their gradients into `.grad`): the step of that node and a loss of one product
   per parameter, less the same loss on plain leaf copies, per parameter. `--profile` prints
   cProfile's heaviest functions of the tess eager step.
2. **Per collective** (8 gloo processes, mesh `[2,2,2]`): each collective of
   the per-rank graph on a `[batch, seq, hidden]` block, `--calls` times, as
   three nested layers: the process group's call alone (made once per plan,
   `tess_compile.core.group_calls`, its wait included, so waiting for peers
   counts there), the communicator's plan around it (`DistComm.plan`: the
   record, the copies the op's contract needs, the error handling), and
   the graph target (the custom op `tess::<op>` with autograd recording,
   called as the per-rank graph calls it). Columns: the c10d call, and the
   microseconds each outer layer adds per call: medians over calls, then the
   median over ranks. The same again for rank 0 alone, in one process on
   torch's fake process group (each c10d call returns at once): the Python
   alone, without the waits and wake-ups of 8 processes on shared cores.
3. **Compiled at `[2,2,2]`, custom ops against functional collectives**: the
   same stack under `shard(model, 2, 2, compile=True)`, once with every
   collective a `tess::` custom op that calls back into Python, once lowered
   to torch's functional collectives (`tess_compile.runtime.functional_collectives`);
   where this tree has no such lowering, or with `--functional off`, the row
   says so. Eager `[2,2,2]` runs beside them for reference.
4. **Host time per collective and per parameter** (`--sections fake`; `benchmarks/overhead_fake_pg.py`):
   the eager step of rank 0 of `[2,2,2]` and of 1-D over 8 ranks on torch's fake process group, and
   of a world of one, in one process: microseconds of host time per collective and per parameter of
   a step, against the targets of 10 and 2.

The CPU cores are shared by all processes of a launch: these are host times on
this machine, not GPU predictions.

    python3 benchmarks/overhead.py [--layers 4] [--hidden 32] [--heads 4] [--batch 4] [--seq 8]
        [--rounds 15] [--steps 20] [--warmup 5] [--calls 200] [--sections one,collectives,compiled,fake]
        [--no-compile] [--functional auto|on|off] [--profile] [--quick] [--out benchmarks/results/overhead.json]

`--quick` runs tiny sizes, few repeats and eager rows only (compiling costs
minutes), for the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from benchmarks.paper_tables import Block
from tess_compile.core import group_calls
from tess_compile.core.mesh import Mesh
from tess_compile.ops.collectives import COLLECTIVE_OPS, EAGER_TARGETS, use_comm
from tess_compile.runtime.dist_comm import DistComm
from tess_compile.runtime.dtensors import local_tensors
from tess_compile.runtime.launch import run_local

SIZES = {"layers": 4, "hidden": 32, "heads": 4, "batch": 4, "seq": 8}
QUICK_SIZES = {"layers": 1, "hidden": 16, "heads": 2, "batch": 4, "seq": 4}
REPEATS = {"rounds": 15, "steps": 20, "warmup": 5, "calls": 200}
QUICK_REPEATS = {"rounds": 2, "steps": 2, "warmup": 1, "calls": 5}

# The collectives of section 2: (row label, op, axis, the op's own arguments (after the axis), the
# dim of the block that the op splits or joins, None for the others). broadcast_start is timed with
# its wait, as the overlap schedule runs it.
COLLECTIVE_CASES = [
    ("broadcast along col", "broadcast", "col", (0,)),
    ("broadcast_start + wait along col", "broadcast_start", "col", (0,)),
    ("reduce along row", "reduce", "row", (0,)),
    ("all_reduce along depth", "all_reduce", "depth", ()),
    ("all_gather along col", "all_gather", "col", (2, 2, 1)),
    ("reduce_scatter along row", "reduce_scatter", "row", (2, 2, 1)),
]


def make_model(sizes: dict) -> nn.Module:
    """The GPT stack of `sizes`, the same weights on every call (and rank)."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block(sizes["hidden"], sizes["heads"]) for _ in range(sizes["layers"])])


def make_input(sizes: dict) -> torch.Tensor:
    return torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], generator=torch.Generator().manual_seed(1))


class Runner:
    """One row: a module, its parameters, and the step that section 1 and 3 time."""

    def __init__(self, module: nn.Module, x: torch.Tensor):
        self.module, self.x = module, x
        self.params = list(module.parameters())

    def step(self) -> None:
        for param in self.params:
            param.grad = None
        out = self.module(self.x)
        out = out.to_local() if isinstance(out, torch.distributed.tensor.DTensor) else out
        out.square().mean().backward()

    def warm(self, steps: int) -> None:
        """The first steps (compiles included)."""
        for _ in range(steps):
            self.step()

    def timed(self, steps: int, barrier: bool = False) -> float:
        """Seconds per step of `steps` steps: wall time between barriers where `barrier`, else this
        thread's CPU time (one process, one thread: its host time, whatever else the machine runs)."""
        clock = time.perf_counter if barrier else time.thread_time
        if barrier:
            dist.barrier()
        start = clock()
        for _ in range(steps):
            self.step()
        if barrier:
            dist.barrier()
        return (clock() - start) / steps


def _square_loss(output, target) -> torch.Tensor:
    return output.square().mean()


class StepRunner(Runner):
    """A whole training step of the unsharded model (`sharded=None`) or of a sharded one: zero the
    gradients, forward, the loss of `Runner`, backward, `clip_grad_norm_(1.0)` and fused AdamW;
    the sharded one as one call (`tess_compile.train_step`)."""

    def __init__(self, module: nn.Module, x: torch.Tensor, sharded: bool):
        super().__init__(module, x)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        self.train = tess_compile.train_step(module, self.opt, _square_loss, clip=1.0) if sharded else None

    def step(self) -> None:
        if self.train is not None:
            self.train(self.x)
            return
        self.opt.zero_grad()
        self.module(self.x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.opt.step()


class GraphRunner(Runner):
    """The reference row "per-rank graph alone": a sharded module's per-rank graph called on plain leaf
    tensors (copies of its parameters' local tensors), without the runtime around it."""

    def __init__(self, sharded: nn.Module, x: torch.Tensor):
        self.graph, self.x = sharded.program.runnable, x
        self.params = [p.to_local().detach().clone().requires_grad_() for p in sharded.parameters()]
        assert [s.role for s in sharded.program.slots] == ["param"] * len(self.params) + ["input"]

    def step(self) -> None:
        for param in self.params:
            param.grad = None
        (out,) = self.graph(*self.params, self.x)
        out.square().mean().backward()


class NodeRunner(Runner):
    """The parameters' node alone: a sharded module's DTensor parameters through `local_tensors` (or,
    `plain`, leaf copies of their local tensors as they are), and a loss of one product each (whose
    gradients are fresh tensors, as a graph's mostly are)."""

    def __init__(self, sharded: nn.Module, plain: bool):
        params = list(sharded.parameters())
        self.params = [p.to_local().detach().clone().requires_grad_() for p in params] if plain else params
        self.scales = [torch.full_like(p.to_local(), 0.5) for p in params]
        self.locals = (lambda xs: xs) if plain else local_tensors

    def step(self) -> None:
        for param in self.params:
            param.grad = None
        sum((x * scale).sum() for x, scale in zip(self.locals(self.params), self.scales)).backward()


def _time_rows(runners: list[Runner], rounds: int, steps: int, warmup: int, barrier: bool) -> list[list[float]]:
    """Warm every row up, then `rounds` rounds of `steps` steps of each row in turn; seconds per step."""
    for runner in runners:
        runner.warm(warmup)
    times = [[] for _ in runners]
    for _ in range(rounds):
        for runner, row in zip(runners, times):
            row.append(runner.timed(steps, barrier))
    return times


def _num_ops(module) -> int:
    """Ops of the per-rank graph's forward (calls of a kernel or a graph target)."""
    return sum(1 for node in module.program.graph.graph.nodes if node.op == "call_function")


def _num_collectives(module) -> int:
    return sum(1 for node in module.program.graph.graph.nodes
               if node.op == "call_function" and node.target in COLLECTIVE_OPS)


# Section 1 ------------------------------------------------------------------------------------------


def _world_of_one(rank: int, world_size: int, sizes: dict, repeats: dict, compiled: bool, profile: bool) -> dict:
    model, x = make_model(sizes), make_input(sizes)
    rows = {"unsharded eager": copy.deepcopy(model)}
    if compiled:
        rows["unsharded torch.compile"] = torch.compile(copy.deepcopy(model))
    tess = tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=(x,), timeout=600)
    rows["tess eager"] = tess
    if compiled:
        rows["tess compile=True"] = tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=(x,),
                                                       timeout=600, compile=True)
    runners = [Runner(module, x) for module in rows.values()] + [GraphRunner(tess, x)]
    rows["per-rank graph alone"] = None
    steps = {"unsharded eager": StepRunner(copy.deepcopy(model), x, sharded=False),
             "tess train_step": StepRunner(tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=(x,),
                                                              timeout=600), x, sharded=True)}
    if compiled:
        steps["unsharded torch.compile"] = StepRunner(torch.compile(copy.deepcopy(model)), x, sharded=False)
        steps["tess compile=True train_step"] = StepRunner(tess_compile.shard(
            copy.deepcopy(model), 1, 1, example_inputs=(x,), timeout=600, compile=True), x, sharded=True)
    times = _time_rows(runners + list(steps.values()), repeats["rounds"], repeats["steps"], repeats["warmup"],
                       barrier=False)
    result = {"rows": list(rows), "times": times[:len(runners)], "ops": _num_ops(tess),
              "collectives": _num_collectives(tess), "step_rows": list(steps), "step_times": times[len(runners):]}
    node, plain = _time_rows([NodeRunner(tess, plain=False), NodeRunner(tess, plain=True)], repeats["rounds"],
                             repeats["steps"], repeats["warmup"], barrier=False)
    result["num_params"] = len(list(tess.parameters()))
    result["node_us_per_param"] = (statistics.median(node) - statistics.median(plain)) * 1e6 / result["num_params"]
    if profile:
        result["profile"] = _profile(runners[list(rows).index("tess eager")], repeats["steps"] * repeats["rounds"])
    return result


def _profile(runner: Runner, steps: int) -> str:
    """cProfile's heaviest functions (own time) over `steps` steps of `runner`."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        runner.step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def print_world_of_one(result: dict, sizes: dict, repeats: dict) -> list[dict]:
    names, ops = result["rows"], result["ops"]
    medians = {name: statistics.median(times) for name, times in zip(names, result["times"])}
    eager = medians["unsharded eager"]
    compiled = medians.get("unsharded torch.compile")
    print(f"\n### A world of one: {sizes['layers']} GPT blocks, hidden {sizes['hidden']}, {sizes['heads']} heads, "
          f"batch {sizes['batch']}, sequence {sizes['seq']}, fp32, forward and backward, one gloo process, one "
          f"thread; CPU time of the thread, median over {repeats['rounds']} rounds of {repeats['steps']} steps, "
          f"after {repeats['warmup']} warm-up; {ops} ops in the per-rank graph's forward, {result['collectives']} "
          "collectives\n")
    print("| configuration | ms/step | vs unsharded eager | vs unsharded compiled | host us/op | runtime us/op |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    order = ["unsharded eager", "unsharded torch.compile", "tess eager", "tess compile=True", "per-rank graph alone"]
    for name in order:
        if name not in medians:
            print(f"| {name} | skipped (--no-compile or --quick) | | | | |")
            continue
        seconds = medians[name]
        versus = f"{seconds / compiled:.2f}" if compiled else "-"
        extra = (seconds - eager) * 1e6 / ops
        print(f"| {name} | {seconds * 1e3:.3f} | {seconds / eager:.2f} | {versus} | {seconds * 1e6 / ops:.1f} | "
              f"{extra:+.1f} |")
        rows.append({"configuration": name, "ms_per_step": seconds * 1e3, "vs_eager": seconds / eager,
                     "vs_compiled": seconds / compiled if compiled else None, "host_us_per_op": seconds * 1e6 / ops,
                     "runtime_us_per_op": extra})
    print(f"\nThe parameters' node alone (`local_tensors`, forward and backward, the {result['num_params']} DTensor "
          f"parameters against plain leaf copies, a loss of one product each): "
          f"{result['node_us_per_param']:.1f} us a parameter")
    if "profile" in result:
        print("\ncProfile of the tess eager step (own time):\n")
        print(result["profile"])
    return rows


def print_whole_steps(result: dict, repeats: dict) -> list[dict]:
    """Section 1's second table: whole training steps (`StepRunner`), each against the unsharded model's."""
    medians = {name: statistics.median(times) for name, times in zip(result["step_rows"], result["step_times"])}
    print(f"\nWhole training steps (zero the gradients, forward, backward, clip_grad_norm_(1.0), fused AdamW), "
          f"the same model and batch, median over {repeats['rounds']} rounds:\n")
    print("| configuration | ms/step | vs the unsharded step |")
    print("|---|---:|---:|")
    pairs = [("unsharded eager", "unsharded eager"), ("tess train_step", "unsharded eager"),
             ("unsharded torch.compile", "unsharded torch.compile"),
             ("tess compile=True train_step", "unsharded torch.compile")]
    rows = []
    for name, versus in pairs:
        if name in medians:
            print(f"| {name} | {medians[name] * 1e3:.3f} | {medians[name] / medians[versus]:.2f} |")
            rows.append({"configuration": name, "ms_per_step": medians[name] * 1e3,
                         "vs_unsharded": medians[name] / medians[versus]})
    return rows


# Section 2 ------------------------------------------------------------------------------------------


class Clock:
    """Seconds spent in the wrapped calls since the last `take()`, by `now` (wall time unless told)."""

    def __init__(self, now=time.perf_counter):
        self.seconds, self.now = 0.0, now

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def wrap(self, function):
        @functools.wraps(function)  # a plan's marks too (`own_adjoint`)
        def timed(*args, **kwargs):
            start = self.now()
            try:
                out = function(*args, **kwargs)
            finally:
                self.seconds += self.now() - start
            return _TimedWork(out, self) if kwargs.get("async_op") else out

        return timed


class _TimedWork:
    """An asynchronous collective's Work whose `wait` counts as the collective's time."""

    def __init__(self, work, clock: Clock):
        self.work, self.clock = work, clock

    def wait(self):
        start = self.clock.now()
        try:
            return self.work.wait()
        finally:
            self.clock.seconds += self.clock.now() - start


# What `DistComm`'s plans call on a process group (`tess_compile.core.group_calls`), each made once per plan.
GROUP_CALLS = ("broadcast", "reduce", "all_reduce", "all_gather_single", "reduce_scatter_single")


def timed_makes(make, clock: Clock):
    """`make(...)`, a maker of calls, whose calls `clock` times."""
    return lambda *args: clock.wrap(make(*args))


def c10d_patches(clock: Clock) -> list:
    """Patches that time by `clock` every process-group call of the plans that a communicator makes
    while they hold (the c10d call of each collective, its wait included)."""
    return [mock.patch.object(group_calls, name, timed_makes(getattr(group_calls, name), clock))
            for name in GROUP_CALLS]


def _collectives(rank: int, world_size: int, sizes: dict, calls: int) -> dict:
    """Per case: median microseconds per call of the c10d call, what the plan adds around it,
    and what the graph target adds around that: the eager runtime's (`EAGER_TARGETS`) and the
    custom op's (`torch.ops.tess.<op>`, as a graph traced with the custom ops calls it)."""
    return _measure_collectives(rank, sizes, calls)


def _collectives_one_process(rank: int, world_size: int, sizes: dict, calls: int) -> dict:
    """`_collectives` of rank 0 of 8 on torch's fake process group, in this one process: every c10d
    call returns at once (no peer, no data moved), so the columns are the Python alone."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()  # run_local's gloo group of one, for the fake one of 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    return _measure_collectives(0, sizes, calls)


def _measure_collectives(rank: int, sizes: dict, calls: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh(2, 2)
    comm = DistComm(mesh, init_device_mesh("cpu", mesh.shape, mesh_dim_names=("depth", "row", "col")),
                    timedelta(seconds=600))
    c10d, run = Clock(), Clock()
    patches = c10d_patches(c10d)
    # every call of the communicator is one of its plans (wait: broadcast_start's second half)
    comm._make_plan, comm.wait = timed_makes(comm._make_plan, run), run.wrap(comm.wait)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], generator=torch.Generator().manual_seed(rank))
    out = {}
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(use_comm(comm))
        for label, op, axis, args in COLLECTIVE_CASES:
            custom = getattr(torch.ops.tess, op).default
            targets = {"eager": EAGER_TARGETS[custom], "custom": custom}
            block = x.clone().requires_grad_()  # autograd records the op, as in a training step
            samples = {name: [] for name in targets}
            for call in range(calls + 2):
                for name, target in targets.items():
                    dist.barrier()
                    c10d.take(), run.take()
                    start = time.perf_counter()
                    y = target(block, axis, *args)
                    if op == "broadcast_start":
                        comm.wait(y)
                    total = time.perf_counter() - start
                    if call >= 2:  # the first calls set up the groups' connections
                        samples[name].append((c10d.take(), run.take(), total))
            both = samples["eager"] + samples["custom"]
            out[label] = {
                "c10d_us": statistics.median(s[0] for s in both) * 1e6,
                "run_us": statistics.median(s[1] - s[0] for s in both) * 1e6,
                **{f"{name}_us": statistics.median(s[2] - s[1] for s in samples[name]) * 1e6 for name in targets},
            }
    return out


def print_collectives(results: list[dict], sizes: dict, calls: int, where: str) -> list[dict]:
    labels = [label for label, *_ in COLLECTIVE_CASES]
    print(f"\n### Per collective, {where}, mesh [2,2,2]: a [{sizes['batch']}, {sizes['seq']}, "
          f"{sizes['hidden']}] fp32 block that requires grad, {calls} calls each; medians over calls, then over "
          "ranks (microseconds)\n")
    print("| collective | c10d call | the plan adds | eager target adds | Python per collective, eager | "
          "custom op adds (traced graphs) |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for label in labels:
        c10d, run, eager, custom = (statistics.median(rank[label][key] for rank in results)
                                    for key in ("c10d_us", "run_us", "eager_us", "custom_us"))
        print(f"| {label} | {c10d:.1f} | {run:.1f} | {eager:.1f} | {run + eager:.1f} | {custom:.1f} |")
        rows.append({"collective": label, "c10d_us": c10d, "run_adds_us": run, "eager_target_adds_us": eager,
                     "custom_op_adds_us": custom})
    return rows


# Section 3 ------------------------------------------------------------------------------------------


def functional_lowering_available() -> bool:
    """Whether compile=True can lower the collectives to torch's functional collectives in this tree."""
    if importlib.util.find_spec("tess_compile.runtime.functional_collectives") is None:
        return False
    from tess_compile.runtime import inductor

    return hasattr(inductor, "axis_groups")


@contextlib.contextmanager
def _custom_ops_only():
    """compile=True's collectives kept as `tess::` custom ops, as where there is no lowering: the
    compile takes no process groups (`inductor.axis_groups` gives None, as for the simulator)."""
    from tess_compile.runtime import inductor

    with mock.patch.object(inductor, "axis_groups", lambda comm: None):
        yield


class _CustomOpsRunner(Runner):
    """A compile=True row whose compile (in its first steps) keeps the custom ops."""

    def warm(self, steps: int) -> None:
        with _custom_ops_only():
            super().warm(steps)


def _compiled_222(rank: int, world_size: int, sizes: dict, repeats: dict, functional: bool) -> dict:
    model, x = make_model(sizes), make_input(sizes)
    rows = {"tess eager [2,2,2]": Runner(tess_compile.shard(copy.deepcopy(model), 2, 2, example_inputs=(x,),
                                                           timeout=600), x)}

    def compiled(runner_type):
        return runner_type(tess_compile.shard(copy.deepcopy(model), 2, 2, example_inputs=(x,), timeout=600,
                                              compile=True), x)

    rows["tess compile=True, custom ops"] = compiled(_CustomOpsRunner)
    if functional:
        rows["tess compile=True, functional collectives"] = compiled(Runner)
    times = _time_rows(list(rows.values()), repeats["rounds"], repeats["steps"], repeats["warmup"], barrier=True)
    return {"rows": list(rows), "times": times, "collectives": [_compiled_collectives(r.module) for r in rows.values()]}


def _compiled_collectives(module) -> str:
    """What a row's compiled graphs call for their collectives: "custom ops", "functional collectives",
    or "-" (eager)."""
    if not module.compile:
        return "-"
    rank = module.compiled_program(lambda: module.comm)
    lowered = {graph.lowered for graph in getattr(rank, "graphs", [])}
    return {frozenset({True}): "functional collectives", frozenset({False}): "custom ops"}.get(frozenset(lowered), "mixed")


def print_compiled_222(results: list[dict] | None, sizes: dict, repeats: dict, why_not: str | None) -> list[dict]:
    print(f"\n### Compiled at [2,2,2] (8 gloo processes): custom ops against functional collectives; "
          f"{sizes['layers']} GPT blocks, hidden {sizes['hidden']}, batch {sizes['batch']}, sequence {sizes['seq']}; "
          f"median over {repeats['rounds']} rounds of {repeats['steps']} steps (slowest rank)\n")
    print("| configuration | ms/step | vs custom ops | compiled graphs' collectives |")
    print("|---|---:|---:|---|")
    if results is None:
        print("| tess compile=True, custom ops | - | - | - |")
        print(f"| tess compile=True, functional collectives | not measured: {why_not} | - | - |")
        return []
    names = results[0]["rows"]
    medians = {name: statistics.median(max(times) for times in zip(*(rank["times"][index] for rank in results)))
               for index, name in enumerate(names)}
    custom = medians["tess compile=True, custom ops"]
    rows = []
    for index, name in enumerate(names):
        calls = results[0]["collectives"][index]
        print(f"| {name} | {medians[name] * 1e3:.2f} | {medians[name] / custom:.2f} | {calls} |")
        rows.append({"configuration": name, "ms_per_step": medians[name] * 1e3, "collectives_as": calls})
    if "tess compile=True, functional collectives" not in names:
        print(f"| tess compile=True, functional collectives | not measured: {why_not} | - | - |")
    return rows


# ----------------------------------------------------------------------------------------------------


SECTIONS = ("one", "collectives", "compiled", "fake")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    for name, value in REPEATS.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which sections to run, of {','.join(SECTIONS)} (1 to 4 of the docstring)")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only (sections 1 and 3)")
    parser.add_argument("--functional", choices=("auto", "on", "off"), default="auto",
                        help="section 3's functional-collective row: where this tree lowers (auto), always, never")
    parser.add_argument("--profile", action="store_true", help="print cProfile's view of the tess eager step")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats, eager rows only")
    parser.add_argument("--out", help="also write the results as JSON here (e.g. benchmarks/results/overhead.json)")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    if unknown := [name for name in sections if name not in SECTIONS]:
        parser.error(f"--sections: unknown {unknown}; give some of {','.join(SECTIONS)}")
    sizes = dict(QUICK_SIZES) if args.quick else {name: getattr(args, name) for name in SIZES}
    repeats = dict(QUICK_REPEATS) if args.quick else {name: getattr(args, name) for name in REPEATS}
    compiled = not (args.quick or args.no_compile)
    start = time.perf_counter()
    record = {"sizes": sizes, "repeats": repeats}
    if "one" in sections:
        one = run_local(_world_of_one, 1, args=(sizes, repeats, compiled, args.profile), timeout_s=3600,
                        collective_timeout_s=600)[0]
        record["world_of_one"] = print_world_of_one(one, sizes, repeats)
        record["world_of_one_whole_steps"] = print_whole_steps(one, repeats)
        record["parameters_node_us_per_param"] = one["node_us_per_param"]
    if "collectives" in sections:
        per_rank = run_local(_collectives, 8, args=(sizes, repeats["calls"]), timeout_s=1800,
                             collective_timeout_s=600)
        record["collectives"] = print_collectives(per_rank, sizes, repeats["calls"], "over gloo, 8 processes")
        alone = run_local(_collectives_one_process, 1, args=(sizes, repeats["calls"]), timeout_s=600)
        record["collectives_one_process"] = print_collectives(
            alone, sizes, repeats["calls"], "rank 0 alone on torch's fake process group (the Python alone)")
    if "compiled" in sections:
        functional = args.functional == "on" or (args.functional == "auto" and functional_lowering_available())
        why_not = None
        if not compiled:
            why_not = "--quick or --no-compile"
        elif not functional:
            why_not = ("--functional off" if args.functional == "off" else
                       "this tree has no functional-collective lowering (tess_compile.runtime.functional_collectives)")
        results = None
        if compiled:
            results = run_local(_compiled_222, 8, args=(sizes, repeats, functional), timeout_s=3600,
                                collective_timeout_s=600)
        record["compiled_222"] = print_compiled_222(results, sizes, repeats, why_not)
    if "fake" in sections:
        from benchmarks.overhead_fake_pg import host_time, print_host_time

        result = run_local(host_time, 1, args=(sizes, repeats), timeout_s=1800)[0]
        record["host_time_fake_pg"] = print_host_time(result, sizes, repeats)
    print(f"\n(CPU cores: {os.cpu_count()}; wall time of the whole run {time.perf_counter() - start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
