"""The process groups a sharded module makes: each times out after the module's `timeout`,
with the options class its backend takes (NCCL refuses the generic one: found on a GPU, where
every `shard` under NCCL failed in `init_device_mesh`)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Backend

from tess_compile.core.mesh import Mesh
from tess_compile.runtime import groups


def test_gloo_groups_take_the_generic_options(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    backend, options = groups._backend_override(timedelta(seconds=7))
    assert backend == "gloo"
    assert isinstance(options, Backend.Options) and options._timeout == timedelta(seconds=7)


def test_nccl_groups_take_nccl_options(monkeypatch):
    class NcclOptions:  # stands in where this torch has no NCCL: the class the backend demands
        _timeout = None

    if not dist.is_nccl_available():
        monkeypatch.setattr(dist, "ProcessGroupNCCL", type("ProcessGroupNCCL", (), {"Options": NcclOptions}),
                            raising=False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    backend, options = groups._backend_override(timedelta(seconds=7))
    assert backend == "nccl"
    assert isinstance(options, dist.ProcessGroupNCCL.Options) and options._timeout == timedelta(seconds=7)




def test_fake_groups_take_no_options(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "fake")
    assert groups._backend_override(timedelta(seconds=7)) == ("fake", None)


def test_groups_build_on_the_fake_process_group(fake_mesh):
    """torch's fake group (one process stands for rank 0 of 8, nothing moves: what
    `benchmarks/overhead.py` times the host's work on) refuses the generic options class."""
    made = groups.mesh_groups("cpu", Mesh(2, 2), timedelta(seconds=7), None)
    assert tuple(made.tp_mesh.shape) == (2, 2, 2) and made.world.rank == 0


def test_a_new_default_group_gets_groups_of_its_own(tmp_path):
    """A process that destroys its default group and makes another (tests, a profile after a run)
    gets the new group's DeviceMesh, not one cached from the destroyed group."""
    mesh = Mesh(1, 1, "1d")
    made = []
    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{attempt}'}", rank=0, world_size=1)
        try:
            made.append(groups.mesh_groups("cpu", mesh, timedelta(seconds=30)))
            made[-1].tp_mesh.get_group("col")  # resolves only under the live default group
        finally:
            dist.destroy_process_group()
    assert made[0].tp_mesh is not made[1].tp_mesh
