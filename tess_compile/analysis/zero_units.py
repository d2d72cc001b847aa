"""ZeRO-3 priced as FSDP2 runs it: one unit per repeated block, each unit's gathers and gradient
reductions overlapped with its neighbours' compute.

Without a pipeline, a ZeRO-3 model of `B > 1` repeated blocks runs one FSDP2 unit per block
(`tess_compile.scale_out.block_units`); otherwise it is one unit (`B = 1`). A unit holds `u = P / B`
of a rank's tensor-parallel parameter bytes `P` (a gradient as many), sharded over `s` replicas
(all `dp`, or HSDP's `zero_shard`). On a ring, one unit's all-gather takes `g` seconds (each rank's
`u / s` bytes out) and its gradient reduction `r` (a reduce-scatter of `u` bytes; HSDP then
all-reduces the `u / s` shard over the `dp / s` groups). The units compute forward `c_f` and
backward `c_b` seconds each (the program's compute over `B`). Per microbatch:

- forward: unit 0's gather is exposed; each later unit's gather runs during the unit before it
  (`set_modules_to_forward_prefetch`): `g + (B-1) * max(0, g - c_f)`;
- backward (units resharded after forward, so gathered again): the last unit's gather is
  exposed; during unit `k`'s backward the link carries unit `k-1`'s gather (prefetched) and
  unit `k+1`'s reduction; unit 0's reduction ends the step:
  `g + max(0, g - c_b) + (B-2) * max(0, g + r - c_b) + max(0, r - c_b) + r`;
- one unit (`B = 1`, FSDP's root, not resharded after forward): `g` forward, `r` backward.

Each collective is priced by `Cluster.collective_seconds` on the data-parallel group alone, on
the intra-node link where the group lies within a node (`dp_link_is_intra`'s rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from tess_compile.core.cluster import Cluster

__all__ = ["ZeroComm", "zero_comm"]


@dataclass(frozen=True)
class ZeroComm:
    """The communication of ZeRO-3 for one microbatch on one rank: what is exposed per phase, and
    what one unit's gather and reduction take (see the module docstring)."""

    units: int
    gather_s: float  # one unit's all-gather
    reduce_s: float  # one unit's gradient reduction (reduce-scatter; HSDP: and its all-reduce)
    forward_s: float  # exposed in forward
    backward_s: float  # exposed in backward
    gather_bytes: int  # one unit's all-gather, as accounting counts it (each rank's shard)

    @property
    def exposed_gather_s(self) -> float:
        """The forward's exposed gathers: the first unit's, and what the others' exceed compute."""
        return self.forward_s


def exposed_forward(units: int, gather: float, compute: float) -> float:
    """Forward's exposed seconds: unit 0's gather, and each later gather beyond its window."""
    return gather + (units - 1) * max(0.0, gather - compute)


def exposed_backward(units: int, gather: float, reduce: float, compute: float) -> float:
    """Backward's exposed seconds (see the module docstring); one unit: its reduction alone."""
    if units == 1:
        return reduce
    middle = (units - 2) * max(0.0, gather + reduce - compute)
    return gather + max(0.0, gather - compute) + middle + max(0.0, reduce - compute) + reduce


def zero_comm(cluster: Cluster, *, param_bytes: int, units: int, shards: int, replicas: int, shard_intra: bool,
              replica_intra: bool, forward_compute_s: float, backward_compute_s: float) -> ZeroComm:
    """ZeRO-3's communication for one microbatch of a rank whose tensor-parallel parameters are
    `param_bytes`, in `units` FSDP2 units sharded over `shards` replicas (on the intra-node link
    if `shard_intra`) and replicated over `replicas` groups (HSDP; `replica_intra` likewise), with
    the program's compute per phase (see the module docstring)."""
    unit = param_bytes // units
    gather_bytes = unit // shards
    gather = cluster.collective_seconds("all_gather", shards, gather_bytes, shard_intra, alone=True)
    reduce = cluster.collective_seconds("reduce_scatter", shards, unit, shard_intra, alone=True)
    reduce += cluster.collective_seconds("all_reduce", replicas, gather_bytes, replica_intra, alone=True)
    return ZeroComm(units, gather, reduce, exposed_forward(units, gather, forward_compute_s / units),
                    exposed_backward(units, gather, reduce, backward_compute_s / units), gather_bytes)
