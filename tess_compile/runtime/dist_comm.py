"""The communicator of one rank over torch.distributed: the per-rank graph's collectives.

Layer: runtime. Each collective names the mesh axis it spans and runs on that
axis's process group (`tess_compile.runtime.groups`): gloo on CPU, NCCL on
CUDA, by its record's `on_process_group` in
`tess_compile.core.collective_table`. Each (op, axis, arguments) is made once
into a plan (`DistComm.plan`: its group, its options, this rank's coordinate,
its record), so a call is the plan's few lines and the process group's own
call. A collective that cannot complete (a peer stopped, or took another path)
fails after the module's timeout with a message that names the op, the axis,
this rank and its peers.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch

from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.ops.collectives import Comm, current_phase

__all__ = ["DistComm"]


class DistComm(Comm):
    """Collectives of this rank over the mesh's process groups.

    `device_mesh` is the `(depth, row, col)` DeviceMesh (with `shard(..., mesh=...)`,
    the tensor-parallel submesh of the user's mesh): this rank's coordinates,
    hence `rank` (its rank within the tensor-parallel group), come from it, not
    from the global rank. `groups` (axis -> process group) overrides its groups.
    """

    def __init__(self, mesh: Mesh, device_mesh, timeout: timedelta, groups: dict | None = None):
        super().__init__()
        self.mesh = mesh
        self.timeout = timeout
        self.rank = mesh.rank(*device_mesh.get_coordinate())
        self.global_ranks = device_mesh.mesh.flatten().tolist()  # global rank of each tensor-parallel rank
        self.groups = groups or {axis: device_mesh.get_group(axis) for axis in AXES}
        self.pending: dict[int, tuple] = {}  # storage pointer -> (work, axis) of a broadcast_start
        self._plans: dict[tuple, Callable] = {}  # (op, axis, *args) -> its plan

    def run(self, op: str, x: torch.Tensor, axis: str, *args) -> torch.Tensor:
        return self.plan(op, axis, *args)(x, current_phase())

    def plan(self, op: str, axis: str, *args) -> Callable[[torch.Tensor, str], torch.Tensor]:
        """`op` along `axis` with its own arguments, made once: `call(x, phase)` records it in
        `phase` and gives this rank's result of `x` (contiguous or not); a failure or timeout
        raised as `_failure` tells it."""
        key = (op, axis, *args)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(op, axis, args)
        return plan

    def _make_plan(self, op: str, axis: str, args: tuple) -> Callable[[torch.Tensor, str], torch.Tensor]:
        collective = COLLECTIVES[op]
        work = collective.on_process_group(self, axis, *args)
        if not collective.sends:  # rank-local: nothing recorded, no peer to fail
            def local(x: torch.Tensor, phase: str) -> torch.Tensor:
                return work(x.contiguous())

            local.own_adjoint = getattr(work, "own_adjoint", False)
            return local
        counts_as, append = collective.counts_as, self._append

        def call(x: torch.Tensor, phase: str) -> torch.Tensor:
            append(counts_as, axis, x, phase)
            try:
                return work(x.contiguous())
            except RuntimeError as err:
                raise self._failure(op, axis, err) from err

        return call

    def _failure(self, op: str, axis: str, err: RuntimeError) -> RuntimeError:
        """A collective's failure or timeout, told with the rank, the axis and the peers."""
        peers = [self.global_ranks[r] for r in self.mesh.group(self.rank, axis)]
        return RuntimeError(
            f"tess collective {op} along {axis} failed on rank {self.global_ranks[self.rank]} "
            f"{self.mesh.coords(self.rank)} of mesh {self.mesh} (peers {peers}): a peer rank stopped, "
            f"or did not reach the same collective within {self.timeout.total_seconds():g}s "
            f"(tess_compile.shard(..., timeout=...)). Cause: {err}"
        )

    def coord(self, axis: str) -> int:
        """This rank's coordinate along `axis`."""
        return self.mesh.coord(self.rank, axis)

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        work, axis = self.pending.pop(x.untyped_storage().data_ptr(), (None, None))
        if work is not None:
            try:
                work.wait()
            except RuntimeError as err:
                raise self._failure("broadcast_start", axis, err) from err
        return x
