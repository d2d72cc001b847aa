"""The check after rewrite, run on every compile: a placement rule that gets a local
shape wrong is a ValueError at compile time that names the node, its source line,
the rule's family, the layouts, the local shapes and the mesh (not a bare
RuntimeError at the first forward)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from tess_compile.passes.driver import compile_model
from tess_compile.passes.rules import lowering_rules, placement_rules
from tess_compile.passes.rules.family import Decision
from tess_compile.core.layout import Layout, Replicate, Shard
from tess_compile.core.mesh import Mesh
from tess_compile.ops.collectives import COLLECTIVE_OPS

aten = torch.ops.aten
R = Replicate()


class Depthwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 7, padding=3, groups=8)

    def forward(self, x):
        return self.conv(x)


class LinearRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


def channels_split_groups_kept(node, ctx):
    """A broken conv rule: channels split over col, but the lowering keeps `groups`."""
    x, weight, bias = node.args[:3]
    channels = Layout(Shard(0), Shard(0), Shard(1))
    return Decision({x: channels, weight: Layout(R, R, Shard(0)), bias: Layout(R, R, Shard(0))}, channels)


def claims_whole_output(node, ctx):
    """A broken pointwise rule: its input stays split over col, its output is said to be whole."""
    x = node.args[0]
    return Decision({x: ctx.layout(x)}, Layout(Shard(0), Shard(0), R))


def replace_rule(monkeypatch, op, rule) -> None:
    monkeypatch.setitem(placement_rules("2.5d"), op, rule)


def line_of(model: nn.Module, text: str) -> str:
    """`file:line` of the line of `model`'s forward that holds `text`."""
    lines, first = inspect.getsourcelines(type(model).forward)
    number = first + next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(type(model))}:{number}"


def compile_error(model, x) -> str:
    with pytest.raises(ValueError) as info:
        compile_model(model, Mesh(2, 2), (x,))  # verify is off: the check runs on every compile
    return str(info.value)


def test_kernel_that_rejects_its_local_inputs(monkeypatch):
    replace_rule(monkeypatch, aten.conv2d.default, channels_split_groups_kept)
    monkeypatch.delitem(lowering_rules("2.5d"), aten.conv2d.default)
    model = Depthwise()
    msg = compile_error(model, torch.randn(4, 8, 16, 16))
    assert msg.startswith("per-rank node conv2d (aten.conv2d.default), made for conv2d (aten.conv2d.default)"), msg
    assert line_of(model, "self.conv(x)") in msg, msg
    assert "family 'convolutions'" in msg, msg
    assert "[1, 4, 16, 16]" in msg and "[4, 1, 7, 7]" in msg, msg  # the local inputs
    assert ", 8):" in msg, msg  # groups as the kernel got it
    assert "Given groups=8" in msg, msg  # the kernel's own message
    assert "S(0)S(0)S(1)" in msg and "RRS(0)" in msg, msg  # the layouts of its inputs
    assert "[q=2, q=2, d=2]" in msg, msg
    assert "report this as a bug of that rule, or pass strict=True" in msg, msg


def test_output_of_another_shape_than_its_layout_promises(monkeypatch):
    replace_rule(monkeypatch, aten.relu.default, claims_whole_output)
    model = LinearRelu()
    msg = compile_error(model, torch.randn(4, 4, 8))
    assert msg.startswith("per-rank node relu (aten.relu.default), made for relu (aten.relu.default)"), msg
    assert line_of(model, "torch.relu") in msg, msg
    assert "family 'pointwise'" in msg, msg
    assert "gives shape [1, 4, 4]" in msg, msg
    assert "layout S(0)S(0)R promises [1, 4, 8] of global shape [4, 4, 8]" in msg, msg
    assert "[q=2, q=2, d=2]" in msg, msg
    assert "report this as a bug of that rule" in msg, msg


def test_per_rank_nodes_name_their_global_node():
    """Every node emitted for a global op, and every node that holds a global value, names it."""
    program = compile_model(LinearRelu(), Mesh(2, 2), (torch.randn(4, 4, 8),))
    nodes = list(program.graph.graph.nodes)
    kernels = [n for n in nodes if n.op == "call_function" and n.target not in COLLECTIVE_OPS]
    # the gradient bucket names itself; its outputs hold the parameters and name them
    assert {n.meta.get("global_node") for n in kernels} == {"linear", "relu", "gradient bucket", "p_fc_weight", "p_fc_bias"}, \
        [n.format_node() for n in kernels]
    holders = {n.meta["global_node"] for n in nodes if "layout" in n.meta}
    assert holders == {"p_fc_weight", "p_fc_bias", "x", "linear", "relu"}, holders


def claims_replicated_output(node, ctx):
    """A broken rule of mode "1d": its input stays split, its output is said to be whole."""
    x = node.args[0]
    return Decision({x: ctx.layout(x)}, Layout.replicated())


def test_mode_1d_names_the_family_and_the_mode(monkeypatch):
    monkeypatch.setitem(placement_rules("1d"), aten.relu.default, claims_replicated_output)
    with pytest.raises(ValueError) as info:
        compile_model(LinearRelu(), Mesh(2, 1, mode="1d"), (torch.randn(4, 4, 8),))
    msg = str(info.value)
    assert "per-rank node relu (aten.relu.default)" in msg and "gives shape [4, 4, 2]" in msg, msg
    assert "family 'pointwise', mode 1d (passes/rules/pointwise.py)" in msg and "1-D [p=4]" in msg, msg
