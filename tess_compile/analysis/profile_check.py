"""How far off a profile's predictions are on this machine: `self_check` times a small model.

Called on every rank of an initialised process group, after `profile_cluster`,
it trains a small model of its own (`_CheckModel`: an embedding, two pre-norm
MLP blocks and an output product; not the profile's reference model, whose
time the profile was fitted to) on each mesh of `check_meshes(world)`: 1-D
over the world and the 2-D/2.5-D `profiling.reference_mesh`. A step is
zero_grad, forward, backward of the mean square of this rank's output block,
and AdamW; its time is the slowest rank's (a barrier before and after), the
median over `steps` steps after `warmup`. Each mesh's program is priced on the
cluster (`cost_model.predict_time`); the mean absolute relative error of the
predicted step times is `Cluster.time_error`, which `with_time_error` sets and
the planner reads to mark rows as ties. `tess-compile profile` runs it unless
`--no-check`.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from tess_compile.analysis.candidate_meshes import mesh_label
from tess_compile.analysis.compile_entry import compile_for
from tess_compile.analysis.cost_model import predict_time
from tess_compile.analysis.profiling import reference_mesh
from tess_compile.analysis.rank_timing import process_group_device, step_seconds
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import CompileOptions
from tess_compile.runtime.sharded_module import shard_program

__all__ = ["check_meshes", "self_check", "with_time_error"]

log = logging.getLogger("tess_compile")

_VOCAB = 256  # tokens of the check model's embedding and output
_WIDTH = 64  # its hidden size
_SEQUENCE = 16  # tokens per row of its input
_TIMEOUT = timedelta(minutes=5)  # of a collective of a checked program


class _CheckModel(nn.Module):
    """The self-check's model: an embedding, two pre-norm MLP blocks (norm, product, activation,
    product, residual), a final norm and an output product."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(
            nn.LayerNorm(_WIDTH), nn.Linear(_WIDTH, 4 * _WIDTH), nn.GELU(),
            nn.Linear(4 * _WIDTH, _WIDTH)) for _ in range(2))
        self.norm = nn.LayerNorm(_WIDTH)
        self.head = nn.Linear(_WIDTH, _VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def check_meshes(world: int) -> list[Mesh]:
    """The meshes the self-check times on `world` ranks: 1-D over the world, and
    `reference_mesh(world)` where that is another."""
    return list(dict.fromkeys([Mesh(1, world, "1d"), reference_mesh(world)]))


def self_check(cluster: Cluster, *, steps: int = 3, warmup: int = 1,
               progress: Callable[[int, int, str], None] | None = None) -> float:
    """The mean absolute relative error of `cluster`'s predicted step times over `check_meshes`,
    measured on every rank of the default process group at once; call on every rank.

    `steps`: timed steps per mesh (their median is taken), after `warmup` untimed ones;
    `progress(done, total, what)`: called before each mesh and once at the end
    (`planner.Progress`; pass one on one rank only). Returns rank 0's error on every rank.
    """
    if not dist.is_initialized():
        raise ValueError("self_check() needs an initialised process group: call it on every rank after "
                         "torch.distributed.init_process_group (or under tess_compile.run_local)")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r}: use an integer >= {least}, e.g. 3")
    device = process_group_device()
    meshes = check_meshes(dist.get_world_size())
    errors = []
    for number, mesh in enumerate(meshes):
        what = f"self-check on {mesh.mode} {mesh_label(mesh)}"
        if progress is not None:
            progress(number, len(meshes), what)
        predicted, measured = _predicted_and_measured(mesh, cluster, device, steps, warmup)
        log.info("%s: predicted %.1f ms, measured %.1f ms", what, predicted * 1e3, measured * 1e3)
        errors.append(abs(predicted - measured) / measured)
    if progress is not None:
        progress(len(meshes), len(meshes), "")
    shared = [statistics.mean(errors)]  # rank 0's: each rank timed the steps on its own clock
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def with_time_error(cluster: Cluster, **check) -> Cluster:
    """`cluster` with `time_error` set by `self_check(cluster, **check)`; call on every rank."""
    return dataclasses.replace(cluster, time_error=self_check(cluster, **check))


def _predicted_and_measured(mesh: Mesh, cluster: Cluster, device: torch.device, steps: int,
                            warmup: int) -> tuple[float, float]:
    """(predicted, measured) seconds of a training step of `_CheckModel` sharded on `mesh`."""
    torch.manual_seed(0)  # the same weights and tokens on every rank
    model = _CheckModel().to(device)
    tokens = torch.randint(_VOCAB, (2 * mesh.num_ranks, _SEQUENCE), device=device)
    compiled = compile_for(model, mesh, (tokens,), CompileOptions(mode=mesh.mode), cluster)  # as `shard` does
    sharded = shard_program(compiled.program, device=device, timeout=_TIMEOUT)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad()
        sharded(tokens).to_local().square().mean().backward()
        optimizer.step()

    return predict_time(sharded.program, cluster).step_s, step_seconds(step, steps, warmup, device)
