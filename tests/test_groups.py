"""The process groups a sharded module makes: each times out after the module's `timeout`,
with the options class its backend takes (NCCL refuses the generic one: found on a GPU, where
every `shard` under NCCL failed in `init_device_mesh`)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Backend

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


