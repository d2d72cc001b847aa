"""User errors: a ValueError whose text gives what, the sizes, the mesh and a fix
(DESIGN.md section 6 item 6); and the replicated fallback for ops without rules."""

from __future__ import annotations

import copy
import inspect
import re
import warnings

import pytest
import torch
from conftest import assert_close_rel
from models import GPTBlock, LlamaBlock
from torch import nn

import tess_compile
from tess_compile.passes.rules import placement_rules


def error_text(q, d, model, x, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        tess_compile.simulate(model, q, d, example_inputs=(x,), verify=True, **kwargs)
    return str(info.value)


def test_depth_larger_than_q():
    msg = error_text(2, 3, GPTBlock(8, 2), torch.randn(12, 4, 8))
    assert "d=3" in msg and "q=2" in msg, msg
    assert "d <= 2" in msg or "d<=2" in msg, msg  # the fix


@pytest.mark.parametrize("q, d", [(0, 1), (0, 0), (2, 0), (-1, 1)], ids=["q0", "q0d0", "d0", "qneg"])
def test_non_positive_mesh(q, d):
    msg = error_text(q, d, GPTBlock(8, 2), torch.randn(4, 4, 8))
    assert f"q={q}" in msg and f"d={d}" in msg, msg
    assert "positive" in msg, msg


def test_batch_not_divisible_by_the_split_asked_for():
    """A batch of 6 compiles on [2,2,2] (whole over row: tests/test_batch_split.py); asked to split it
    over depth and row, the compile refuses, naming the batch, the ranks, the mesh and the fix."""
    msg = error_text(2, 2, GPTBlock(8, 2), torch.randn(6, 4, 8), batch_split="depth_row")
    assert "batch 6" in msg and "4 ranks" in msg, msg
    assert "[q=2, q=2, d=2]" in msg, msg  # the mesh
    assert "multiple of 4" in msg and "batch_split='auto'" in msg, msg  # the fix


def test_hidden_not_divisible_by_q():
    """Products split a hidden size q does not divide unevenly (padded); a norm over it needs
    its true size and refuses, naming the norm, its line, the tensor and the fix."""
    msg = error_text(4, 1, GPTBlock(6, 2), torch.randn(4, 4, 6))
    assert msg.startswith("aten.layer_norm.default"), msg
    assert "of shape [4, 4, 6] split over col on dim 2, whose size 6 is not divisible by 4" in msg, msg
    assert "[q=4, q=4, d=1]" in msg, msg
    assert "the norms rules need its true size; use a size that is a multiple of 4" in msg, msg


@pytest.mark.parametrize("block", [GPTBlock, LlamaBlock], ids=["gpt", "llama"])
def test_heads_not_divisible_by_q(block):
    msg = error_text(2, 1, block(12, 3), torch.randn(2, 4, 12))
    assert "head count" in msg, msg
    assert "3" in msg and "q=2" in msg, msg
    assert "[q=2, q=2, d=1]" in msg, msg
    assert "multiple of 2" in msg, msg


@pytest.mark.parametrize(
    "shape", [(4, 5, 8), (8, 4, 8), (4, 4, 16)], ids=["seq", "batch", "hidden"]
)
def test_call_with_other_shape(shape):
    model = GPTBlock(8, 2)
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(torch.randn(4, 4, 8),), verify=True)
    with pytest.raises(ValueError) as info:
        sim(torch.randn(*shape))
    msg = str(info.value)
    assert str(list(shape)) in msg and "[4, 4, 8]" in msg, msg
    assert "example_inputs" in msg, msg


def test_call_with_other_number_of_inputs():
    model = GPTBlock(8, 2)
    x = torch.randn(4, 4, 8)
    sim = tess_compile.simulate(model, 2, 1, example_inputs=(x,), verify=True)
    with pytest.raises(ValueError) as info:
        sim(x, x)
    assert str(info.value) == (
        "called with 2 positional and keywords [], but compiled for 1 positional and keywords []: "
        "call it with the same arguments as example_inputs"
    )


class TwoInputs(nn.Module):
    """y = linear(x) + a * b, negated if `flip`; `pair` is a list [a, b]."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x, pair, flip=False, mask=None):
        y = self.linear(x) + pair[0] * pair[1]
        return -y if flip else y


def two_inputs_sim(**example_kwargs):
    torch.manual_seed(0)
    model = TwoInputs(8)
    x, pair = torch.randn(4, 3, 8), [torch.randn(8), torch.randn(8)]
    example = {"x": x, "pair": pair, **example_kwargs} if example_kwargs else (x, pair)
    return model, tess_compile.simulate(model, 2, 1, example_inputs=example, verify=True), x, pair


def call_error(sim, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        sim(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 300, f"not one readable line: {msg!r}"
    return msg


FIX = "call it with the same arguments as example_inputs"


def test_call_with_other_structure():
    """One line that says where the call and the compiled inputs part, never a TreeSpec."""
    _, sim, x, pair = two_inputs_sim()
    cases = [
        ((x, pair), {"mask": x}, "called with 2 positional and keywords ['mask'], but compiled for 2 positional and keywords []"),
        ((x,), {}, "called with 1 positional and keywords [], but compiled for 2 positional and keywords []"),
        ((x, x), {}, "positional input 1 is a tensor of shape [4, 3, 8], but compiled for a list of 2"),
        ((x, pair[:1]), {}, "positional input 1 is a list of 1, but compiled for a list of 2"),
        ((x, [pair[0], [pair[1]]]), {}, "positional input 1[1] is a list of 1, but compiled for a tensor of shape [8]"),
        ((x, tuple(pair)), {}, "positional input 1 is a tuple of 2, but compiled for a list of 2"),
    ]
    for args, kwargs, expected in cases:
        assert call_error(sim, *args, **kwargs) == f"{expected}: {FIX}"


def test_call_with_other_dtype():
    _, sim, x, pair = two_inputs_sim()
    assert call_error(sim, x.double(), pair) == (
        "positional input 0 has dtype torch.float64, but the module was compiled for torch.float32: "
        "cast it (.to(torch.float32)), or compile again with example_inputs of dtype torch.float64"
    )
    msg = call_error(sim, x, [pair[0], pair[1].half()])
    assert msg.startswith("positional input 1[1] has dtype torch.float16, but the module was compiled for torch.float32"), msg


def test_call_with_other_token_id_dtype():
    """int32 ids where int64 were compiled: said before anything runs, not by torch mid-graph."""
    from models import TinyGPT

    model = TinyGPT(16, 8, 2, 1, 4)
    ids = torch.randint(0, 16, (4, 4))
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(ids,))
    msg = call_error(sim, ids.int())
    assert "positional input 0" in msg and "torch.int32" in msg and "torch.int64" in msg, msg
    assert ".to(torch.int64)" in msg, msg


def test_keywords_in_any_order_and_by_name():
    model, sim, x, pair = two_inputs_sim(flip=True)
    assert_close_rel(sim(flip=True, pair=pair, x=x), model(x, pair, True), name="output")
    assert call_error(sim, pair=pair, x=x.double(), flip=True).startswith(
        "keyword input 'x' has dtype torch.float64"
    )
    assert call_error(sim, x, pair, True) == (
        f"called with 3 positional and keywords [], but compiled for 0 positional and keywords "
        f"['flip', 'pair', 'x']: {FIX}"
    )


def test_call_with_other_flag():
    """Values that are not tensors are fixed at compile time: another value is refused,
    not silently run with the compiled one."""
    _, sim, x, pair = two_inputs_sim(flip=False)
    assert call_error(sim, x=x, pair=pair, flip=True) == (
        "keyword input 'flip' is True, but the module was compiled for False (values that are not tensors "
        "are fixed at compile time): call it with False, or compile again with example_inputs that hold True"
    )
    assert call_error(sim, x=x, pair=pair, flip=torch.ones(1)) == (
        f"keyword input 'flip' is a tensor, but compiled for the value False: {FIX}"
    )


def test_input_on_another_device():
    """For a runtime that does not move inputs to its device."""
    _, sim, x, pair = two_inputs_sim()
    with pytest.raises(ValueError) as info:
        sim.program.flatten_inputs((x, pair), {}, device="meta")
    assert str(info.value) == "positional input 0 is on device cpu, but the module runs on meta: move it there (.to('meta'))"


class FlipModel(nn.Module):
    """Linear, flip over the batch dim (no sharding rule for aten.flip), linear."""

    def __init__(self, hidden: int):
        super().__init__()
        self.first = nn.Linear(hidden, hidden)
        self.second = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.second(torch.flip(self.first(x), dims=[0]))


class TwoFlips(nn.Module):
    """Two layers of linear then flip, both flips made by one line."""

    def __init__(self, hidden: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.flip(layer(x), dims=[0])
        return x


def line_of(method, text: str) -> str:
    """`file:line` of the line of `method` that contains `text`."""
    source, first = inspect.getsourcelines(method)
    return f"{inspect.getsourcefile(method)}:{first + next(i for i, line in enumerate(source) if text in line)}"


def test_flip_is_not_in_the_rule_table():
    assert torch.ops.aten.flip.default not in placement_rules("2.5d")


def test_strict_rejects_op_without_rule():
    msg = error_text(2, 2, FlipModel(8), torch.randn(4, 3, 8), strict=True)
    assert "flip" in msg, msg
    assert line_of(FlipModel.forward, "torch.flip") in msg, msg  # the op's own source line
    assert "strict" in msg, msg


def test_replicated_ops_are_reported_once_per_compile():
    """One warning: a line per op and source line, with the number of nodes and the bytes a
    rank gathers (x [4, 3, 8] float32 split [2, 3, 4] at q=2, d=1: 72 of 96 elements, twice)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tess_compile.simulate(TwoFlips(8), 2, 1, example_inputs=(torch.randn(4, 3, 8),))
    reports = [str(w.message) for w in caught if "sharding rule" in str(w.message)]
    assert len(reports) == 1, reports
    where = line_of(TwoFlips.forward, "torch.flip")
    assert reports[0].splitlines()[1:] == [f"  aten.flip.default x2 at {where}: gathers 576 bytes a rank"], reports[0]


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2)], ids=["q2d1", "q2d2"])
def test_non_strict_warns_and_matches(q, d):
    torch.manual_seed(5)
    model = FlipModel(8)
    reference = copy.deepcopy(model)
    x = torch.randn(2 * d * q, 3, 8)
    with pytest.warns(UserWarning, match=re.escape("aten.flip")) as record:
        sim = tess_compile.simulate(model, q, d, example_inputs=(x,), verify=True)
    assert any("test_errors.py" in str(w.message) for w in record), [str(w.message) for w in record]

    x_sim, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = sim(x_sim), reference(x_ref)
    assert_close_rel(out, expected, name="output")
    target = torch.randn_like(expected)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    assert_close_rel(x_sim.grad, x_ref.grad, name="input grad")
    grads = sim.full_grads()
    for name, param in reference.named_parameters():
        assert_close_rel(grads[name], param.grad, name=f"grad of {name}")


def test_supported_model_does_not_warn():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tess_compile.simulate(nn.Linear(8, 8), 2, 2, example_inputs=(torch.randn(4, 3, 8),), strict=False)
    assert [str(w.message) for w in caught if "sharding rule" in str(w.message)] == []


class Flipped(nn.Module):
    """Two layers, each flipping its features (no sharding rule: runs replicated)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).flip(-1)
        return x


def test_replicated_ops_are_summarised_once_at_their_own_line():
    """One warning per compile: a line per op and source line, with its count and the
    bytes a rank gathers to run it whole."""
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tess_compile.simulate(Flipped(), 2, 2, example_inputs=(x,))
    reports = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert len(reports) == 1, reports
    source, first = inspect.getsourcelines(Flipped.forward)
    line = first + next(i for i, text in enumerate(source) if ".flip(-1)" in text)
    lines = reports[0].splitlines()
    assert lines[0].startswith("2 op(s) have no sharding rule and run replicated on mesh [q=2, q=2, d=2]"), reports[0]
    # Each flip gathers the 7/8 of its [4, 8] float32 input that a rank does not hold
    # (its block: batch over depth and row, features over col).
    assert lines[1:] == [f"  aten.flip.default x2 at {inspect.getsourcefile(Flipped)}:{line}: gathers 224 bytes a rank"], reports[0]


@pytest.mark.parametrize("face", ["simulate", "check", "dump", "shard"])
def test_anything_but_a_module_is_told_what_to_pass(face):
    with pytest.raises(ValueError, match=rf"tess_compile.{face}\(model=...\): got a builtins.function, and it takes a "
                                         r"torch.nn.Module: pass the model itself"):
        getattr(tess_compile, face)(lambda t: t * 2, 2, 1, example_inputs=(torch.randn(4, 3, 8),))


class MeanOfIntegers(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x.mean(-1, keepdim=True).expand(-1, -1, 8))  # a mean of integers fails in torch


def test_an_error_of_the_model_itself_is_that_error_at_its_line_without_torch_logging(caplog):
    ids = torch.ones(4, 3, 8, dtype=torch.long)
    with pytest.raises(RuntimeError) as own:
        MeanOfIntegers()(ids)
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError) as raised:
        tess_compile.simulate(MeanOfIntegers(), 2, 1, example_inputs=(ids,))
    message = str(raised.value)
    assert message.startswith(str(own.value)), message
    assert f"raised by MeanOfIntegers's own code at {__file__}:" in message and "x.mean(-1" in message, message
    assert "failed while attempting to run meta" not in caplog.text, caplog.text
