"""Convolutions, pooling and batch norm sharded exactly (passes/rules/convolutions.py,
pooling.py, norms.py): grouped and depthwise convs run their own groups, convs on
split channels are row-parallel, batch norm's training statistics are all-reduced
over the batch's axes. Float64 against the unsharded model, in train and eval mode,
at 2.5-D [2,2,2] and 1-D p=4, with no rank repeating another's conv work."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_close_rel
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import redundant_work, unsharded_forward_flops

# num_batches_tracked += 1 may run replicated (an in-place add_ on a scalar: 8 bytes, no work).
pytestmark = pytest.mark.filterwarnings("ignore:.*have no sharding rule")

MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
MESH_IDS = ["2.5d-q2d2", "1d-p4"]


class GroupedConvs(nn.Module):
    """A grouped conv, a depthwise conv and a pointwise conv, each with BatchNorm."""

    def __init__(self):
        super().__init__()
        self.grouped = nn.Conv2d(8, 16, 3, padding=1, groups=4)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pointwise = nn.Conv2d(16, 8, 1)
        self.norms = nn.ModuleList(nn.BatchNorm2d(c) for c in (16, 16, 8))

    def forward(self, x):
        for conv, norm in zip((self.grouped, self.depthwise, self.pointwise), self.norms):
            x = torch.relu(norm(conv(x)))
        return x


class ConvChain(nn.Module):
    """conv -> bn -> relu -> max pool -> conv -> bn -> relu -> avg pool -> adaptive pool -> linear."""

    def __init__(self):
        super().__init__()
        stem_conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem = nn.Sequential(stem_conv, nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AvgPool2d(2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


class BasicBlock(nn.Module):
    """A ResNet basic block with a strided 1x1 shortcut and the residual add."""

    def __init__(self, c_in: int = 4, c_out: int = 8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=2, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out)) + self.shortcut(x)
        return torch.relu(out).mean((2, 3))


class Sequences(nn.Module):
    """conv1d grouped and depthwise with BatchNorm1d and 1-d pooling; a depthwise conv3d."""

    def __init__(self):
        super().__init__()
        self.grouped = nn.Conv1d(4, 8, 3, padding=1, groups=4)
        self.norm = nn.BatchNorm1d(8)
        self.depthwise = nn.Conv1d(8, 8, 3, padding="same", groups=8)
        self.pool = nn.AdaptiveAvgPool1d(2)
        self.volume = nn.Conv3d(8, 8, 1, groups=8)

    def forward(self, x):
        x = nn.functional.max_pool1d(self.depthwise(torch.relu(self.norm(self.grouped(x)))), 2)
        x = self.pool(x)
        return self.volume(x[..., None, None]).flatten(1)


CASES = {
    "grouped": (GroupedConvs, (4, 8, 6, 6)),
    "chain": (ConvChain, (4, 3, 8, 8)),
    "basic-block": (BasicBlock, (4, 4, 8, 8)),
    "sequences": (Sequences, (4, 4, 8)),
}


def _replicated_ops(caught) -> set[str]:
    """The ops of the compiler's warnings: those that run replicated, and convs with whole channels."""
    ops = set()
    for warning in caught:
        text = str(warning.message)
        if "run replicated" in text:
            ops.update(line.split()[0] for line in text.splitlines()[1:])
        elif "whole on every rank" in text:
            ops.add(text.split()[0])
    return ops


def _buffers(state: dict) -> dict:
    return {name: value for name, value in state.items() if "running" in name}


@pytest.mark.parametrize("q, d, mode", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_exact_in_train_and_eval_without_redundant_work(name, q, d, mode):
    cls, shape = CASES[name]
    torch.manual_seed(0)
    model = cls().double().train()
    oracle = copy.deepcopy(model)
    x = torch.randn(shape, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode, verify=True)
    assert _replicated_ops(caught) <= {"aten.add_.Tensor"}, "only num_batches_tracked += 1 may run replicated"
    assert redundant_work(sim.program, unsharded_forward_flops(oracle, (x,))) <= 1.05
    for step in range(2):  # the second step starts from updated running statistics
        out, expected = sim(x + step), oracle(x + step)
        assert_close_rel(out, expected, 1e-12, "train output")
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        (out * target).sum().backward()
        (expected * target).sum().backward()
    # A conv bias before BatchNorm has a zero gradient: measure each on the model's scale.
    grads = sim.full_grads()
    scale = max(param.grad.abs().max().item() for param in oracle.parameters())
    for param_name, param in oracle.named_parameters():
        error = (grads[param_name] - param.grad).abs().max().item()
        assert error <= 1e-12 * scale, f"grad {param_name}: {error:.2e} against the largest gradient {scale:.2e}"
    expected_buffers = _buffers(oracle.state_dict())
    for buffer_name, value in _buffers(sim.full_state_dict()).items():
        assert_close_rel(value, expected_buffers[buffer_name], 1e-12, buffer_name)
    sim.eval()
    oracle.eval()
    assert_close_rel(sim(x), oracle(x), 1e-12, "eval output")


def test_grouped_conv_runs_its_own_groups():
    """groups=4 on col's 2 ranks: each rank holds 2 groups' weights and input channels."""
    torch.manual_seed(0)
    model = GroupedConvs().double()
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(torch.randn(4, 8, 6, 6, dtype=torch.float64),))
    layouts = {slot.name: str(slot.layout) for slot in sim.program.slots}
    assert layouts["grouped.weight"] == layouts["depthwise.weight"] == "RRS(0)"
    assert layouts["pointwise.weight"] == "RRS(1)", "channels split: row-parallel"
    assert layouts["norms.0.running_mean"] == "RRS(0)"
    assert list(sim.rank_tensor("grouped.weight", 0).shape) == [8, 2, 3, 3]
    calls = [n for n in sim.program.runnable.graph.nodes if n.target is torch.ops.aten.conv2d.default]
    assert [c.args[6] for c in calls[:2]] == [2, 8], "local groups: groups / 2"


def test_groups_that_do_not_divide_run_whole_over_col_with_a_warning():
    """groups=3 on col's 2 ranks: channels whole over col, batch still split; exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(6, 6, 3, groups=3), nn.BatchNorm2d(6)).double()
    oracle = copy.deepcopy(model)
    x = torch.randn(4, 6, 5, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"groups 3 on mesh .*channels are whole on every rank of col"):
        sim = tess_compile.simulate(model, 2, 2, example_inputs=(x,))
    assert_close_rel(sim(x), oracle(x), 1e-12, "output")
    assert redundant_work(sim.program, unsharded_forward_flops(oracle, (x,))) == pytest.approx(2.0)
