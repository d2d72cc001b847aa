"""Timing on every rank of a process group at once, as training runs: what a profile, its
self-check and the benchmarks time with.

`Timer` times a function the way `tess_compile.analysis.profiling` measures the machine
(repeated runs of about `RUN_S` seconds, all ranks busy together, the slowest rank's time);
`step_seconds` times a training step between barriers; `world_mean` and `world_max` agree
on a figure over the ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["RUN_S", "Timer", "device_now", "process_group_device", "step_seconds", "world_max", "world_mean"]

RUN_S = 0.05  # seconds of one timed run (the calls of a fast function repeated to fill it)


class Timer:
    """Times a function on every rank at once, as training runs it: all ranks busy together.

    After a warm-up call, each timed run calls the function `calls` times in a loop of
    about `RUN_S` seconds, `calls` agreed by all ranks (a collective is called as often
    on each). A run of local work ends at a barrier, so its time is the slowest rank's,
    as a training step waits for it at the next collective. The result is the median
    over `repeats` runs of one call's time, averaged over the ranks. Each measurement is
    reported to `progress` (of `total`) as it starts."""

    def __init__(self, device: torch.device, repeats: int, progress: Callable[[int, int, str], None] | None,
                 total: int):
        self.device = device
        self.repeats = repeats
        self.progress = progress
        self.total = total
        self.done = 0

    def median(self, fn: Callable[[], object], what: str, local: bool = True) -> float:
        if self.progress is not None:
            self.progress(self.done, self.total, what)
        self.done += 1
        fn()  # warm-up: first-call allocations and lazy initialisation
        start = self._now()
        fn()
        calls = max(1, round(RUN_S / max(world_max(self._now() - start), 1e-7)))
        times = []
        for _ in range(self.repeats):
            dist.barrier()
            start = self._now()
            for _ in range(calls):
                fn()
            if local:
                dist.barrier()
            times.append((self._now() - start) / calls)
        return statistics.median(times)

    def mean(self, fn: Callable[[], object], what: str) -> float:
        """`median` of local work averaged over all ranks (the same value on every rank)."""
        return world_mean([self.median(fn, what)])[0]

    def finish(self) -> None:
        """Report the end to `progress`."""
        assert self.done == self.total, f"{self.done} measurements taken, {self.total} counted"
        if self.progress is not None:
            self.progress(self.total, self.total, "")

    def _now(self) -> float:
        return device_now(self.device)


def device_now(device: torch.device) -> float:
    """`time.perf_counter()` once `device`'s queued work is done (CUDA runs it asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def process_group_device() -> torch.device:
    """Where a rank of the default process group runs: the current CUDA device under NCCL, else the CPU."""
    return torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")


def step_seconds(step: Callable[[], object], steps: int, warmup: int, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None) -> float:
    """The median over `steps` calls of `step` of the slowest rank's time (a barrier of `group`, None:
    the default group, before and after each), after `warmup` untimed calls; call on every rank."""
    device = device or process_group_device()
    times = []
    for number in range(warmup + steps):
        dist.barrier(group=group)
        start = device_now(device)
        step()
        dist.barrier(group=group)
        if number >= warmup:
            times.append(device_now(device) - start)
    return statistics.median(times)


def world_max(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest of `value` over the ranks of `group` (None: the default group)."""
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    return total.item()


def world_mean(values: list[float]) -> list[float]:
    """Each value averaged over the ranks, rank 0's result sent to all so that every rank
    holds the same numbers to the last bit."""
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    dist.broadcast(total, src=0)
    return (total / dist.get_world_size()).tolist()
