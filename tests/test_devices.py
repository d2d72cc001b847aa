"""Tensors made inside forward follow the device the per-rank graph runs on, not the
device it was captured on: a model that builds a mask and positions on its input's
device, captured on CPU, runs on the meta device (real and fake runs), is planned,
and (on a GPU machine) runs on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Interpreter

import tess_compile
from tess_compile.passes.driver import compile_model
from tess_compile.core.fake_run import local_placeholder
from tess_compile.core.mesh import Mesh
from tess_compile.ops.local import device_of


class MaskedMixer(nn.Module):
    """A linear layer, then a causal average over the sequence with a mask and positions
    made on the input's device (as attention masks and position ids are)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        s = x.shape[1]
        mask = torch.tril(torch.ones(s, s, device=x.device))
        positions = torch.arange(s, device=x.device).to(x.dtype)
        mixed = (mask / mask.sum(-1, keepdim=True)) @ self.fc(x)
        return mixed + positions[None, :, None]


def make_masked():
    return MaskedMixer(8), torch.randn(4, 4, 8)


def placeholders(program, device: str) -> list:
    with torch.device(device):
        return [local_placeholder(n, program.mesh) for n in program.graph.graph.nodes if n.op == "placeholder"]


def test_capture_reads_the_device_at_run_time():
    model, x = make_masked()
    program = compile_model(model, Mesh(2, 2), (x,), strict=True)
    devices = [n for n in program.graph.graph.nodes if n.target is device_of]
    assert len(devices) == 1 and len(devices[0].users) >= 2, program.graph.code
    assert "device(type='cpu')" not in program.graph.code, program.graph.code


def test_cpu_capture_runs_fake_on_the_meta_device():
    model, x = make_masked()
    program = compile_model(model, Mesh(2, 2), (x,), strict=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = Interpreter(program.graph).run(*placeholders(program, "meta"))
    assert out[0].device.type == "meta" and list(out[0].shape) == [1, 4, 4]


def test_cpu_capture_runs_on_the_meta_device():
    model, x = make_masked()
    program = compile_model(model, Mesh(1, 1), (x,), strict=True)
    out = program.graph(*placeholders(program, "meta"))
    assert out[0].device.type == "meta" and list(out[0].shape) == [4, 4, 8]


def test_plan_of_a_model_that_builds_a_mask_on_its_input_device():
    rows = tess_compile.plan(make_masked, 8)
    assert [row.note for row in rows if row.time is None] == []
    assert len(rows) == 2


def test_simulated_parity():
    model, x = make_masked()
    oracle = copy.deepcopy(model)
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(x,), strict=True, verify=True)
    assert_close_rel(sim(x), oracle(x), name="output")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_capture_runs_on_cuda():
    model, x = make_masked()
    program = compile_model(model, Mesh(1, 1), (x,), strict=True)
    tensors = {slot.name: program.local_tensor(slot, 0, device="cuda") for slot in program.slots if slot.role == "param"}
    inputs = [tensors[slot.name] if slot.role == "param" else x.cuda() for slot in program.slots]
    out = program.graph(*inputs)
    assert out[0].device.type == "cuda"
    assert_close_rel(out[0].cpu(), model(x), name="output")
