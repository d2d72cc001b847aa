"""Block reuse: a model's repeated blocks compiled once give the program a whole compile gives.

`compile_model` compiles a model of five or more alike blocks as four of them and copies the
per-rank nodes of the middle one (`passes/repeated_blocks.py`, `passes/expand_blocks.py`);
`reuse_blocks=False` compiles every block. The two per-rank graphs must be the same node for
node (op, target, arguments, every `meta` key but torch's `val`), with the same slots and
schedule counts, and the analyses must price them alike: bytes, FLOPs, step time and the
step's peak (`tess_compile.analysis.block_reuse` prices a reused program from two short ones).
Fast: the programs of a TinyGPT of five blocks in 2.5-D, and of a stack whose blocks run
under torch.utils.checkpoint in 1-D. Slow: the TinyGPT's predictions, and those of a program compiled only to be priced
(`priced_only=True`, whose whole per-rank graph is never built); the zoo's decoders made five blocks deep
(transformers' GPT-2 and Mixtral in 1-D over 4 ranks, Llama with grouped KV heads and
torchtitan's Llama 3 on `[2, 2, 2]`), programs and predictions; Gemma 2, whose layers
alternate, has no repeated blocks to reuse.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
from models import GPTStack, TinyGPT
from torch import nn
from torch.fx.node import map_aggregate

from tess_compile.passes.capture import capture
from tess_compile.passes.capture_reuse import captures_reused
from tess_compile.passes.driver import compile_model
from tess_compile.passes.repeated_blocks import find_repeated_blocks
from tess_compile.analysis.accounting import forward_flops, predict_bytes
from tess_compile.analysis.cost_model import predict_time
from tess_compile.analysis.memory import predict_memory, step_working
from tess_compile.core.cluster import CALIBRATED_CLUSTER
from tess_compile.core.mesh import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCKS = 5


def quiet_compile(model, mesh, inputs, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return compile_model(model, mesh, inputs, **options)
        finally:
            logging.disable(logging.NOTSET)


def rows(gm) -> list[tuple]:
    """Each node as (op, target, arguments by position, its meta but `val`), placeholders by name."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    out = []
    for node in gm.graph.nodes:
        args = map_aggregate((node.args, node.kwargs), lambda a: ("node", index[a]) if isinstance(a, torch.fx.Node) else a)
        meta = sorted((key, str(value)) for key, value in node.meta.items() if key != "val")
        out.append((node.op, node.name if node.op == "placeholder" else str(node.target), str(args), meta))
    return out


def assert_same_program(reused, whole) -> None:
    assert reused.repeats is not None and whole.repeats is None
    got, expected = rows(reused.graph), rows(whole.graph)
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert first is None and len(got) == len(expected), (
        f"{len(got)} nodes against {len(expected)}; first difference at {first}:\n"
        f"{got[first] if first is not None else ''}\n{expected[first] if first is not None else ''}")
    assert reused.slots == whole.slots
    assert reused.schedules == whole.schedules


def assert_same_predictions(reused, whole) -> None:
    """Bytes, FLOPs and memory exactly; seconds to rounding (the short programs' sums add in another order)."""
    assert predict_bytes(reused, inputs_require_grad=True) == predict_bytes(whole, inputs_require_grad=True)
    assert forward_flops(reused) == forward_flops(whole)
    # a reused program's estimate also holds its step's working and update parts, from the short steps
    # its peak ran (a whole program's estimate leaves them out): they are the whole program's step's
    estimate = predict_memory(reused)
    assert dataclasses.replace(estimate, working=None, update=None) == predict_memory(whole)
    if estimate.working is not None:
        assert (estimate.working, estimate.update) == step_working(whole)
    got, expected = predict_time(reused, CALIBRATED_CLUSTER), predict_time(whole, CALIBRATED_CLUSTER)
    assert (got.forward_bytes, got.backward_bytes) == (expected.forward_bytes, expected.backward_bytes)
    for name in ("forward_s", "backward_s", "step_s"):
        assert getattr(got, name) == pytest.approx(getattr(expected, name), rel=1e-12), name


def deeper(model: nn.Module, blocks: int = BLOCKS) -> nn.Module:
    """`model` with `blocks` layers: a transformers model rebuilt from its config, another with copies of
    the last element of its longest ModuleList or ModuleDict."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers") and hasattr(model, "generate"):
        config = copy.deepcopy(config)
        config.num_hidden_layers = blocks
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(blocks)]
        torch.manual_seed(0)
        return type(model)(config).to(next(model.parameters()).dtype)
    model = copy.deepcopy(model)
    layers = max((m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))), key=len)
    last = list(layers.children())[-1]
    while len(layers) < blocks:
        layers.add_module(str(len(layers)), copy.deepcopy(last))
    return model


@pytest.fixture(scope="module")
def tiny_gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=32, hidden=16, heads=4, layers=BLOCKS, seq=8), torch.randint(0, 32, (8, 8))


def both(model, mesh, inputs, **options):
    """The program compiled with block reuse and without, on one capture."""
    with captures_reused():
        return quiet_compile(model, mesh, inputs, **options), quiet_compile(model, mesh, inputs, reuse_blocks=False,
                                                                            **options)


def test_tiny_gpt_reused_is_the_whole_compile(tiny_gpt):
    model, ids = tiny_gpt
    assert_same_program(*both(model, Mesh(2, 2), (ids,)))


@pytest.mark.slow
def test_tiny_gpt_priced_from_its_short_forms_as_the_whole(tiny_gpt):
    """A reused program, and one compiled only to be priced (its whole per-rank graph never built), price
    as the whole compile."""
    model, ids = tiny_gpt
    with captures_reused():
        priced = quiet_compile(model, Mesh(2, 2), (ids,), priced_only=True)
        reused, whole = both(model, Mesh(2, 2), (ids,))
    assert priced.slots == whole.slots and priced.schedules == whole.schedules
    assert_same_predictions(reused, whole)
    assert_same_predictions(priced, whole)


def test_checkpointed_blocks_in_1d_reused_are_the_whole_compile():
    torch.manual_seed(0)
    model, x = GPTStack(16, 4, BLOCKS, checkpoint="non-reentrant"), torch.randn(4, 8, 16)
    assert_same_program(*both(model, Mesh(2, 1, "1d"), (x,)))


# the zoo's decoders made five blocks deep, each on one mesh
ZOO_CASES = [("gpt2", Mesh(2, 1, "1d")), ("llama-gqa", Mesh(2, 2)), ("mixtral", Mesh(2, 1, "1d")),
             ("titan-llama3", Mesh(2, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh", ZOO_CASES, ids=[f"{name}-{mesh.mode}" for name, mesh in ZOO_CASES])
def test_zoo_decoder_reused_is_the_whole_compile(name, mesh):
    from benchmarks.architectures import build

    case = build(name)
    reused, whole = both(deeper(case.model), mesh, case.inputs)
    assert_same_program(reused, whole)
    assert_same_predictions(reused, whole)


@pytest.mark.slow
def test_alternating_layers_are_not_reused():
    from benchmarks.architectures import build

    case = build("gemma2")
    assert find_repeated_blocks(capture(deeper(case.model), (), case.inputs)) is None
