"""Section 4 of `benchmarks/overhead.py`: the eager runtime's host time per collective and per
parameter of a training step, against the targets of 10 us a collective and 2 us a parameter.

One process runs rank 0 of each case, the GPT stack of `overhead.py` (`make_model`), a step
as its section 1 (`Runner`: zero the gradients, forward, a loss of the output, backward; no
optimizer). On torch's fake process group (`dist.init_process_group("fake", ...)`) every
c10d call returns at once: nothing moves and no peer is waited for, so a step's time is the
host's work alone, that of 8 ranks without 8 processes. Cases: a world of one (whose program
calls no collective), rank 0 of `[2,2,2]` (mode 2.5d) and rank 0 of 1-D over 8 ranks (mode 1d,
8 heads), on fake groups of 1, 8 and 8.

Per case, medians over rounds of the thread's CPU time per step (`time.thread_time`):

- the step of `tess_compile.shard`'s module, and of its per-rank graph alone (`GraphRunner`,
  with the runtime's `eager_graph` and communicator: the same collectives, on plain leaf
  copies of the parameters' local tensors);
- per collective: a step's time inside its collective ops (each eager target the graph calls,
  forward; the backward of each collective's autograd Function, and each of the communicator's
  plans not inside one, such as a fused product's fetches: autograd's Function, the plan
  (`DistComm.plan`) and the process group's call; their calls counted, the rank-local ones such
  as `shard_slice` and identity adjoints too), over the step's collectives that move bytes
  (`comm.records`, forward and backward); and of that, the process group's calls alone (the C++
  call and its wait: torch's own floor, which on the fake group copies the input into each
  rank's part of an all-gather's output);
- per parameter: the module's step less the graph's alone, over the parameters: all the
  runtime does around the per-rank graph (inputs, the parameters' local tensors and their
  gradients' DTensors, the output's DTensor), fixed costs of a step included.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist

import tess_compile
from benchmarks.overhead import (
    Clock,
    GraphRunner,
    Runner,
    StepRunner,
    c10d_patches,
    make_input,
    make_model,
    timed_makes,
)
from tess_compile.ops import collectives
from tess_compile.ops.collectives import EAGER_TARGETS, use_comm
from tess_compile.runtime.sharded_module import eager_graph

__all__ = ["CASES", "host_time", "print_host_time"]

TARGET_US_PER_COLLECTIVE, TARGET_US_PER_PARAMETER = 10.0, 2.0

# (label, q, d, mode, world size of the fake process group, sizes changed from the stack's): 1-D over
# 8 ranks splits the heads 8 ways, so that case runs 8 heads (of 4 features each) on the same hidden size
CASES = [
    ("world of one", 1, 1, "2.5d", 1, {}),
    ("rank 0 of [2,2,2], 2.5d", 2, 2, "2.5d", 8, {}),
    ("rank 0 of p=8, 1d", 2, 2, "1d", 8, {"heads": 8}),
]


class _OuterClock:
    """CPU seconds in the wrapped calls, and their number, since the last `take()`; a wrapped call
    inside another (a communicator's `run` inside an eager target) counts as part of the outer one."""

    def __init__(self):
        self.seconds, self.calls, self.depth = 0.0, 0, 0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def take_calls(self) -> int:
        calls, self.calls = self.calls, 0
        return calls

    def wrap(self, function):
        @functools.wraps(function)  # a plan's marks too (`own_adjoint`)
        def timed(*args, **kwargs):
            if self.depth:
                return function(*args, **kwargs)
            self.depth, self.calls = 1, self.calls + 1
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start
                self.depth = 0

        return timed


class _TimedGraphRunner(GraphRunner):
    """The per-rank graph alone as the runtime calls it (its `eager_graph`, under the module's
    communicator), each eager target of a collective that it calls timed by `clock`."""

    def __init__(self, sharded, x: torch.Tensor, clock: _OuterClock):
        super().__init__(sharded, x)
        self.comm, self.clock = sharded.comm, clock
        self.graph = eager_graph(self.graph)
        for node in self.graph.graph.nodes:
            if node.op == "call_function" and node.target in EAGER_TARGETS.values():
                node.target = clock.wrap(node.target)
        self.graph.recompile()

    def step(self) -> None:
        with use_comm(self.comm):
            super().step()


class _GraphStepRunner(GraphRunner):
    """The per-rank graph alone in `StepRunner`'s whole step: its clipping and fused AdamW on the
    graph's plain leaf copies of the parameters' local tensors."""

    def __init__(self, sharded, x: torch.Tensor):
        super().__init__(sharded, x)
        self.comm, self.graph = sharded.comm, eager_graph(self.graph)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=True)

    def step(self) -> None:
        self.opt.zero_grad()
        with use_comm(self.comm):
            (out,) = self.graph(*self.params, self.x)
            out.square().mean().backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.opt.step()


def _rounds(runner: Runner, clocks: list, rounds: int, steps: int) -> tuple[list[float], list[list[float]]]:
    """Seconds per step of each round of `runner`, and each clock's seconds per step in them."""
    times, taken = [], [[] for _ in clocks]
    for _ in range(rounds):
        for clock in clocks:
            clock.take()
        times.append(runner.timed(steps))
        for clock, row in zip(clocks, taken):
            row.append(clock.take() / steps)
    return times, taken


def _case(q: int, d: int, mode: str, sizes: dict, repeats: dict) -> dict:
    model, x = make_model(sizes), make_input(sizes)
    sharded = tess_compile.shard(copy.deepcopy(model), q, d, example_inputs=(x,), mode=mode, timeout=600)
    module = Runner(sharded, x)
    inside, c10d = _OuterClock(), Clock(time.thread_time)  # CPU time, as the steps
    graph = _TimedGraphRunner(sharded, x, inside)
    # the process group's calls; the backward of each collective's autograd Function (its adjoint),
    # and every plan of the communicator not inside one (the collectives of fused ops such as
    # `FetchedProduct`): in both rows, the same cost. The plans are made anew under the patches.
    sharded.comm._plans.clear()
    patches = [*c10d_patches(c10d), mock.patch.object(sharded.comm, "_make_plan", timed_makes(
        sharded.comm._make_plan, inside))]
    patches += [mock.patch.object(function, "backward", staticmethod(inside.wrap(function.backward)))
                for function in (collectives._Collective, collectives._IdentityWithAdjoint)]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        module.warm(repeats["warmup"])
        graph.warm(repeats["warmup"])
        sharded.comm.records.clear()
        module.step()
        num_collectives = len(sharded.comm.records)
        module_times, _ = _rounds(module, [], repeats["rounds"], repeats["steps"])
        inside.take_calls()
        graph.step()
        calls = inside.take_calls()
        graph_times, (inside_times, c10d_times) = _rounds(graph, [inside, c10d], repeats["rounds"], repeats["steps"])
    train = StepRunner(tess_compile.shard(copy.deepcopy(model), q, d, example_inputs=(x,), mode=mode, timeout=600),
                       x, sharded=True)
    graph_step = _GraphStepRunner(sharded, x)
    train.warm(repeats["warmup"])
    graph_step.warm(repeats["warmup"])
    train_times, graph_step_times = [], []
    for _ in range(repeats["rounds"]):
        train_times.append(train.timed(repeats["steps"]))
        graph_step_times.append(graph_step.timed(repeats["steps"]))
    return {"train_s": statistics.median(train_times), "graph_step_s": statistics.median(graph_step_times),
            "params": len(module.params), "collectives": num_collectives, "calls": calls,
            "module_s": statistics.median(module_times),
            "graph_s": statistics.median(graph_times), "inside_s": statistics.median(inside_times),
            "c10d_s": statistics.median(c10d_times)}


def host_time(rank: int, world_size: int, sizes: dict, repeats: dict) -> dict:
    """Every case of `CASES`, in this one process (run_local's world of one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for label, q, d, mode, world, changed in CASES:
        dist.destroy_process_group()  # run_local's gloo group, or the last case's: a fake one of `world`
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        out[label] = _case(q, d, mode, {**sizes, **changed}, repeats)
    return out


def print_host_time(result: dict, sizes: dict, repeats: dict) -> list[dict]:
    print(f"\n### Host time per collective and per parameter, eager, one process: {sizes['layers']} GPT blocks, "
          f"hidden {sizes['hidden']}, batch {sizes['batch']}, sequence {sizes['seq']}, forward and backward; rank 0 "
          f"of 8 ([2,2,2] and 1-D) and a world of one on torch's fake process group (c10d returns at once); CPU time of the "
          f"thread, median over {repeats['rounds']} rounds of {repeats['steps']} steps (targets: "
          f"{TARGET_US_PER_COLLECTIVE:g} us a collective, {TARGET_US_PER_PARAMETER:g} us a parameter)\n")
    print("| case | parameters | collectives/step | collective-op calls/step | step ms | graph alone ms | "
          "us/collective | of it c10d | runtime us/parameter | train_step ms | graph's whole step ms | "
          "train_step us/parameter |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for label, case in result.items():
        count = case["collectives"]
        per_collective = case["inside_s"] * 1e6 / count if count else None
        c10d = case["c10d_s"] * 1e6 / count if count else None
        per_param = (case["module_s"] - case["graph_s"]) * 1e6 / case["params"]
        per_param_step = (case["train_s"] - case["graph_step_s"]) * 1e6 / case["params"]
        shown = [f"{value:.1f}" if value is not None else "-" for value in (per_collective, c10d)]
        print(f"| {label} | {case['params']} | {count} | {case['calls']} | {case['module_s'] * 1e3:.3f} | "
              f"{case['graph_s'] * 1e3:.3f} "
              f"| {shown[0]} | {shown[1]} | {per_param:.1f} | {case['train_s'] * 1e3:.3f} | "
              f"{case['graph_step_s'] * 1e3:.3f} | {per_param_step:.1f} |")
        rows.append({"case": label, "parameters": case["params"], "collectives_per_step": count,
                     "collective_op_calls_per_step": case["calls"],
                     "step_ms": case["module_s"] * 1e3, "graph_alone_ms": case["graph_s"] * 1e3,
                     "us_per_collective": per_collective, "c10d_us_per_collective": c10d,
                     "runtime_us_per_parameter": per_param, "train_step_ms": case["train_s"] * 1e3,
                     "graph_whole_step_ms": case["graph_step_s"] * 1e3,
                     "train_step_us_per_parameter": per_param_step})
    return rows
