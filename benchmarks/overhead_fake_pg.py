"""Section 4 of `benchmarks/overhead.py`: the eager runtime's host time per collective and per
parameter of a training step, against the targets of 10 us a collective and 2 us a parameter.

One process runs rank 0 of each case, the GPT stack of `overhead.py` (`make_model`), a step
as its section 1 (`Runner`: zero the gradients, forward, a loss of the output, backward; no
optimizer). On torch's fake process group (`dist.init_process_group("fake", ...)`) every
c10d call returns at once: nothing moves and no peer is waited for, so a step's time is the
host's work alone, that of 8 ranks without 8 processes. Cases: rank 0 of `[2,2,2]` (mode
2.5d), on a fake group of 8; and a world of one, on a gloo group of one (a
program of one rank calls no collective; torch 2.13's fake backend cannot build the size-1
groups of a `[1,1,1]` DeviceMesh: its creator refuses the generic `Backend.Options` that
`new_group` hands it).

Per case, medians over rounds of the thread's CPU time per step (`time.thread_time`):

- the step of `tess_compile.shard`'s module, and of its per-rank graph alone (`GraphRunner`,
  with the runtime's `eager_graph` and communicator: the same collectives, on plain leaf
  copies of the parameters' local tensors);
- per collective: a step's time inside its collectives (each eager target the graph calls,
  forward, and each adjoint, backward: autograd's Function, `DistComm.run` and the c10d call),
  over the step's collectives (`comm.records`, forward and backward); and of that, the c10d
  calls alone (torch's own floor);
- per parameter: the module's step less the graph's alone, over the parameters: all the
  runtime does around the per-rank graph (inputs, the parameters' local tensors and their
  gradients' DTensors, the output's DTensor), fixed costs of a step included.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from unittest import mock

import torch
import torch.distributed as dist

import tess_compile
from benchmarks.overhead import C10D_CALLS, Clock, GraphRunner, Runner, make_input, make_model
from tess_compile.ops import collectives
from tess_compile.ops.collectives import EAGER_TARGETS, use_comm
from tess_compile.runtime.sharded_module import eager_graph

__all__ = ["CASES", "host_time", "print_host_time"]

TARGET_US_PER_COLLECTIVE, TARGET_US_PER_PARAMETER = 10.0, 2.0

# (label, q, d, mode, world size of the default group: 1 is run_local's gloo group of one, 8 a fake one)
CASES = [
    ("world of one", 1, 1, "2.5d", 1),
    ("rank 0 of [2,2,2], 2.5d", 2, 2, "2.5d", 8),
]


class _TimedGraphRunner(GraphRunner):
    """The per-rank graph alone as the runtime calls it (its `eager_graph`, under the module's
    communicator), each eager target of a collective that it calls timed by `clock`."""

    def __init__(self, sharded, x: torch.Tensor, clock: Clock):
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


def _rounds(runner: Runner, clocks: list[Clock], rounds: int, steps: int) -> tuple[list[float], list[list[float]]]:
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
    inside, c10d = Clock(), Clock()
    graph = _TimedGraphRunner(sharded, x, inside)
    # the c10d calls, and each adjoint a collective's backward runs (in both rows: the same cost)
    patches = [mock.patch.object(dist, name, c10d.wrap(getattr(dist, name)))
               for name in C10D_CALLS if hasattr(dist, name)]
    patches.append(mock.patch.object(collectives, "_adjoint", inside.wrap(collectives._adjoint)))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        module.warm(repeats["warmup"])
        graph.warm(repeats["warmup"])
        sharded.comm.records.clear()
        module.step()
        num_collectives = len(sharded.comm.records)
        module_times, _ = _rounds(module, [], repeats["rounds"], repeats["steps"])
        graph_times, (inside_times, c10d_times) = _rounds(graph, [inside, c10d], repeats["rounds"], repeats["steps"])
    return {"params": len(module.params), "collectives": num_collectives, "module_s": statistics.median(module_times),
            "graph_s": statistics.median(graph_times), "inside_s": statistics.median(inside_times),
            "c10d_s": statistics.median(c10d_times)}


def host_time(rank: int, world_size: int, sizes: dict, repeats: dict) -> dict:
    """Every case of `CASES`, in this one process (run_local's world of one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for label, q, d, mode, world in CASES:
        if world != dist.get_world_size():
            dist.destroy_process_group()  # run_local's gloo group of one, for a fake one of `world`
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        out[label] = _case(q, d, mode, sizes, repeats)
    return out


def print_host_time(result: dict, sizes: dict, repeats: dict) -> list[dict]:
    print(f"\n### Host time per collective and per parameter, eager, one process: {sizes['layers']} GPT blocks, "
          f"hidden {sizes['hidden']}, batch {sizes['batch']}, sequence {sizes['seq']}, forward and backward; rank 0 "
          f"of 8 on torch's fake process group (c10d returns at once), a world of one on gloo; CPU time of the "
          f"thread, median over {repeats['rounds']} rounds of {repeats['steps']} steps (targets: "
          f"{TARGET_US_PER_COLLECTIVE:g} us a collective, {TARGET_US_PER_PARAMETER:g} us a parameter)\n")
    print("| case | parameters | collectives/step | step ms | graph alone ms | us/collective | of it c10d | "
          "runtime us/parameter |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for label, case in result.items():
        count = case["collectives"]
        per_collective = case["inside_s"] * 1e6 / count if count else None
        c10d = case["c10d_s"] * 1e6 / count if count else None
        per_param = (case["module_s"] - case["graph_s"]) * 1e6 / case["params"]
        shown = [f"{value:.1f}" if value is not None else "-" for value in (per_collective, c10d)]
        print(f"| {label} | {case['params']} | {count} | {case['module_s'] * 1e3:.3f} | {case['graph_s'] * 1e3:.3f} "
              f"| {shown[0]} | {shown[1]} | {per_param:.1f} |")
        rows.append({"case": label, "parameters": case["params"], "collectives_per_step": count,
                     "step_ms": case["module_s"] * 1e3, "graph_alone_ms": case["graph_s"] * 1e3,
                     "us_per_collective": per_collective, "c10d_us_per_collective": c10d,
                     "runtime_us_per_parameter": per_param})
    return rows
