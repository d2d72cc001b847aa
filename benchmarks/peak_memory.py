"""The peak memory of a training step per rank: predicted against tracked, every mode and recompute
option, and data parallel, ZeRO and pipeline stages around [2,2,1].

The GPT stack of `benchmarks/memory.py` (4 blocks, hidden 128, 8 heads, batch 16, sequence 64,
fp32 by default) is sharded over 8 gloo processes (`tess_compile.shard`, [2,2,2] for 2.5-D and
3-D, 1-D over p = 8; 2-D over [2,2] in 4 processes). Each rank runs two training steps under
torch's `MemTracker` (`torch.distributed._tools.mem_tracker`) without its module hooks
(`analysis.step_record.step_tracker`): forward, backward from the local output with a gradient of ones
(as a loss's backward hands it), AdamW's step, gradients set to None. Its tracked peak, the most
bytes of tensors alive at once (parameters, inputs, activations, gradients, temporaries, optimizer
state), is compared with the prediction, `predict_memory(program).total`
(`tess_compile.analysis.memory.step_peak`: the same step on fake tensors), and with the old figure,
what a rank holds at the start of backward (`at_backward`).

The README rows (`--only readme`) run README's training loop in place of that step: the output
gathered whole on every rank (`tess_compile.full_tensor`), the loss outside the module (its mean
square, `step_tail.square_mean`), AdamW, then `zero_grad()` to None or, in the rows marked
"zeros", `zero_grad(set_to_none=False)`; 2.5-D [2,2,2] and 1-D p = 8, with and without
recompute="blocks". Their prediction is `predict_memory(program, StepTail(...))` of the same tail.

The outer rows run 8 gloo processes around the 2-D mesh [2,2,1], the same two steps:

- `dp`, `zero`: data parallel 2 x [2,2,1], `shard(..., mesh=root, zero=...)` on the mesh
  `(dp, depth, row, col) = (2, 1, 2, 2)`, each replica on its half of the batch (ZeRO: FSDP2);
- `1f1b`, `gpipe`: 2 pipeline stages x [2,2,1] (`pipeline_stage`, the stack's blocks in halves)
  under torch's `Schedule1F1B` / `ScheduleGPipe`, 4 microbatches, the loss the sum of the last
  stage's output block; stage 0 holds the whole batch, as `schedule.step(x)` takes it.

Their peak is counted by `LiveBytes` (MemTracker's count without its module hooks: see there) and
compared with the planner's: `parallel_plan.price` around `tess_compile.plan`'s row of [2,2,1] for
one microbatch, called as the planner calls it (`planned`), its `total` and `at_backward`.

    python3 benchmarks/peak_memory.py [--layers 4] [--hidden 128] [--heads 8] [--batch 16] [--seq 64]
                                      [--only tp,readme,dp,zero,pp]
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from benchmarks.memory import Stack
from tess_compile.analysis.memory import MemoryEstimate, predict_memory
from tess_compile.analysis.parallel_plan import Outer, boundary_bytes, price
from tess_compile.analysis.step_record import step_tracker
from tess_compile.analysis.step_tail import MODULE_LOSS, StepTail
from tess_compile.core.cluster import CALIBRATED_CLUSTER
from tess_compile.runtime.launch import run_local

MIB = 2**20
RECOMPUTE = ("none", "blocks", "selective")
MESHES = {"2.5d": (2, 2), "3d": (2, 2), "1d": (2, 2), "2d": (2, 1)}  # mode: (q, d); 1-D: p = q * q * d
OUTER = {"dp": Outer(dp=2), "zero": Outer(dp=2, zero=True), "1f1b": Outer(pp=2, microbatches=4),
         "gpipe": Outer(pp=2, microbatches=4, schedule="gpipe")}
GROUPS = {"tp": tuple(MESHES), "readme": ("2.5d", "1d"), "dp": ("dp",), "zero": ("zero",),
          "pp": ("1f1b", "gpipe")}  # --only's names
TAILS = {"module": MODULE_LOSS, "readme": StepTail(), "readme zeros": StepTail(set_to_none=False)}  # the step column
Q, D = 2, 1  # the mesh of every outer row: [2,2,1], 2-D


def _model(size: dict):
    torch.manual_seed(0)
    model = Stack(size["layers"], size["hidden"], size["heads"])
    x = torch.randn(size["batch"], size["seq"], size["hidden"])
    return model, x


def tracked_peak(step, *external, calls: int = 2) -> int:
    """The most bytes of tensors alive at once in `calls` calls of `step`, under torch's `MemTracker`
    without its module hooks (`analysis.step_record.step_tracker`: they would hold a recompute region's
    weight gradients to the end of backward; `external`: the modules, optimizers and tensors made
    before it)."""
    tracker = step_tracker()
    tracker.track_external(*external)
    with tracker:
        for _ in range(calls):
            tracker.reset_mod_stats()  # the tracker refuses a module's second call otherwise
            step()
    return max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storages alive at once (`peak`): a storage counts from the op that
    makes it (a DTensor's through its local tensor) until it is freed, at the size
    `UntypedStorage.resize_` gives it (FSDP frees and refills its gathered parameters so);
    `track` adds those made before (a module's parameters and buffers, an optimizer's state, tensors).

    What `MemTracker` counts, without its module hooks: MemTracker refuses a module called twice in
    a step (a pipeline stage, once a microbatch), and its hook on a module's inputs holds their
    gradients until the last one arrives (`register_multi_grad_hook`), which under data parallelism
    keeps each local gradient alive beside its average, as the run does not."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple] = {}  # the address of a storage -> (a weakref to it, its bytes)
        self.now = self.peak = 0

    def track(self, *objects) -> None:
        for obj in objects:
            if isinstance(obj, nn.Module):
                self.track(*obj.parameters(), *obj.buffers())
            elif isinstance(obj, torch.optim.Optimizer):
                self.track(*(v for s in obj.state.values() for v in s.values() if isinstance(v, torch.Tensor)))
            else:
                for storage in get_untyped_storages(obj):
                    if storage._cdata not in self.live:
                        self.live[storage._cdata] = (weakref.ref(storage, partial(self._freed, storage._cdata)), 0)
                        self._resized(storage)

    def _resized(self, storage) -> None:
        ref, old = self.live[storage._cdata]
        self.live[storage._cdata] = (ref, storage.nbytes())
        self.now += storage.nbytes() - old
        self.peak = max(self.peak, self.now)

    def _freed(self, key: int, _ref) -> None:
        self.now -= self.live.pop(key)[1]

    def __enter__(self):
        resize = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            resize(storage, size)
            if storage._cdata in self.live:
                self._resized(storage)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # let DTensor run its local ops, which this mode then sees
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is None:  # not DTensor's sharding propagation on fake tensors
            self.track(*(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


def live_peak(step, *external) -> int:
    """The peak of `LiveBytes` over two calls of `step` (`external`: as `tracked_peak`'s)."""
    counter = LiveBytes()
    counter.track(*external)
    with counter:
        for _ in range(2):
            step()
    return counter.peak


def _training_step(module, optimizer, x, tail: StepTail = MODULE_LOSS):
    """Forward, `tail` (`MODULE_LOSS`: backward from the local output with a gradient of ones; README's
    loop: the output gathered, a loss of it), AdamW, `zero_grad` in the tail's mode."""

    def tail_of(out):
        return tess_compile.full_tensor(out) if tail.gather else out.to_local()

    def step():
        if tail.loss is None:
            out = tail_of(module(x))
            out.backward(torch.ones_like(out))
        else:  # as README writes it: the gathered output held by the loss alone
            tail.loss(tail_of(module(x))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=tail.set_to_none)

    return step


def tracked_peaks(rank: int, world: int, size: dict, configs: list) -> list[dict]:
    """Each (mode, recompute, step) of `configs` on this rank (`step`: a key of `TAILS`): the tracked peak
    of two training steps, and the prediction's total and start-of-backward figure."""
    rows = []
    for mode, recompute, step in configs:
        q, d = MESHES[mode]
        model, x = _model(size)
        sharded = tess_compile.shard(model, q, d, example_inputs=(x,), mode=mode, recompute=recompute)
        optimizer = torch.optim.AdamW(sharded.parameters())
        tracked = tracked_peak(_training_step(sharded, optimizer, x, TAILS[step]), sharded, optimizer, x)
        predicted = predict_memory(sharded.program, TAILS[step])
        rows.append({"mode": mode, "recompute": recompute, "step": step, "ranks": world, "tracked": tracked,
                     "predicted": predicted.total, "at_backward": predicted.at_backward})
    return rows


def _data_parallel(model, x, zero: bool):
    """This rank's step of data parallel 2 x [2,2,1] (ZeRO: FSDP2 over dp) on its replica's half of the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh("cpu", (2, D, Q, Q), mesh_dim_names=("dp", "depth", "row", "col"))
    rows = x.shape[0] // 2
    group = root.get_local_rank("dp")
    x = x[group * rows:(group + 1) * rows].clone()  # its own storage: the replica holds only its half
    sharded = tess_compile.shard(model, Q, D, example_inputs=(x,), mode="2d", mesh=root, zero=zero, timeout=300)
    optimizer = torch.optim.AdamW(sharded.parameters())
    return _training_step(sharded, optimizer, x), (sharded, optimizer, x)


def _pipeline(model, x, outer: Outer):
    """This rank's step of a pipeline of 2 stages x [2,2,1] (the stack's blocks in halves) under torch's
    `Schedule1F1B` or `ScheduleGPipe`, as `outer` says."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    microbatches = outer.microbatches
    stage_index = dist.get_rank() // (Q * Q * D)
    half = len(model.blocks) // 2
    part = nn.Sequential(*(model.blocks[:half] if stage_index == 0 else model.blocks[half:]))
    rows = x.shape[0] // microbatches
    example = (x[:rows],) if stage_index == 0 else (torch.zeros_like(x[:rows]),)
    stage = tess_compile.pipeline_stage(part, Q, D, stage_index, 2, example_inputs=example, mode="2d", timeout=300)
    schedule_class = Schedule1F1B if outer.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_class(stage, n_microbatches=microbatches, loss_fn=lambda out, _: out.to_local().sum())
    optimizer = torch.optim.AdamW(stage.submod.parameters())
    target = torch.zeros(x.shape[0])

    def step():
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (stage.submod, optimizer, x if stage_index == 0 else target)


def outer_peaks(rank: int, world: int, size: dict, names: list) -> list[int]:
    """The peak `LiveBytes` counts in two training steps of each outer row of `names` on this rank."""
    peaks = []
    for name in names:
        model, x = _model(size)
        outer = OUTER[name]
        step, external = _pipeline(model, x, outer) if outer.pp > 1 else _data_parallel(model, x, outer.zero)
        peaks.append(live_peak(step, *external))
    return peaks


def planned(size: dict, name: str) -> MemoryEstimate:
    """The planner's memory per rank for the outer row `name`: `price` around the row of [2,2,1]
    that `tess_compile.plan` makes for one microbatch, called as the planner calls it (with the
    row's schedule: the planner itself prices 1F1B)."""
    outer = OUTER[name]
    model, x = _model(size)
    micro = x[:x.shape[0] // (outer.dp * outer.microbatches)]
    rows = tess_compile.plan(model, Q * Q * D, example_inputs=(micro,), modes=("2d",), keep_blocks=False,
                             tail=MODULE_LOSS)
    row = next(r for r in rows if r.mesh.q == Q and r.mesh.d == D)
    tp = row.mesh.num_ranks
    block = boundary_bytes(model, (micro,)) // tp if outer.pp > 1 else 0  # this rank's block of it
    inputs = micro.numel() * micro.element_size() if outer.pp > 1 else 0  # as the planner passes them
    return price(row.time, row.memory, outer, tp, CALIBRATED_CLUSTER, block, inputs)[1]


def measure(size: dict, configs: list) -> list[dict]:
    """The worst rank's row of each config (largest relative error), the 8-rank meshes in one
    launch of 8 processes and 2-D in one of 4."""
    rows = []
    for world in (8, 4):
        chosen = [c for c in configs if (world == 4) == (c[0] == "2d")]
        if not chosen:
            continue
        per_rank = run_local(tracked_peaks, world, args=(size, chosen), timeout_s=600)
        for k in range(len(chosen)):
            rows.append(max((ranks[k] for ranks in per_rank), key=lambda r: abs(r["predicted"] / r["tracked"] - 1)))
    return rows


def measure_outer(size: dict, names: list) -> list[dict]:
    """The row of each outer configuration of `names`: the worst rank's counted peak (the largest)
    against the planner's prediction, over one launch of 8 processes."""
    if not names:
        return []
    per_rank = run_local(outer_peaks, 2 * Q * Q * D, args=(size, names), timeout_s=900, collective_timeout_s=600)
    rows = []
    for k, name in enumerate(names):
        memory = planned(size, name)
        rows.append({"mode": name, "recompute": "none", "step": "module", "ranks": len(per_rank),
                     "tracked": max(r[k] for r in per_rank),
                     "predicted": memory.total, "at_backward": memory.at_backward})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':<6} {'ranks':>5} {'recompute':<10} {'step':<12} {'tracked MiB':>11} {'predicted MiB':>13} "
          f"{'error':>7} {'at backward MiB':>15} {'error':>7}")
    for r in rows:
        print(f"{r['mode']:<6} {r['ranks']:>5} {r['recompute']:<10} {r['step']:<12} {r['tracked'] / MIB:11.2f} "
              f"{r['predicted'] / MIB:13.2f} {100 * (r['predicted'] / r['tracked'] - 1):6.1f}% "
              f"{r['at_backward'] / MIB:15.2f} {100 * (r['at_backward'] / r['tracked'] - 1):6.1f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 8), ("batch", 16), ("seq", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--only", default=",".join(GROUPS), help=f"rows to run, of {', '.join(GROUPS)}")
    args = parser.parse_args(argv)
    only = args.only.split(",")
    unknown = [name for name in only if name not in GROUPS]
    if unknown:
        parser.error(f"unknown rows {unknown[0]!r}: use {', '.join(GROUPS)}")
    size = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "batch", "seq")}
    print(f"GPT stack {size}, fp32, AdamW; the worst rank of each mesh")
    modes = GROUPS["tp"] if "tp" in only else ()
    configs = [(mode, r, "module") for mode in modes for r in RECOMPUTE]
    if "readme" in only:
        configs += [(mode, r, step) for mode in GROUPS["readme"] for r in ("none", "blocks")
                    for step in ("readme", "readme zeros")]
    rows = measure(size, configs)
    outer = [name for group in only if group not in ("tp", "readme") for name in GROUPS[group]]
    rows += measure_outer(size, outer)
    if outer:
        print("dp, zero: 2 x [2,2,1]; 1f1b, gpipe: 2 stages x [2,2,1], 4 microbatches; counted by LiveBytes, "
              "predicted by the planner (parallel_plan.price)")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
