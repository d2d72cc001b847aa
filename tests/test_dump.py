"""Graph dumps: golden text at [2, 2, 2] for two ranks (checked inline, regenerated
only on purpose with TESS_UPDATE_GOLDEN=1), header bytes equal to the bytes the
runtime moved, the other stages and formats, and bad options."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from models import GPTBlock, LlamaBlock, mesh_id
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import bytes_from_records, predict_bytes
from tess_compile.analysis.graph_dump import dump, dump_program

GOLDEN_LINEAR_RANK0 = """\
# tess-compile rewritten graph, mesh [q=2, q=2, d=2], 8 ranks
# rank 0 at (k, i, j) = (0, 0, 0); peers along depth [0, 4], row [0, 2], col [0, 1]
# parameter bytes on this rank: 24
# summa=auto on mesh [q=2, q=2, d=2]: gather for 1 product (priced on the default cluster (CALIBRATED_CLUSTER))
# rows: batch over depth_row, tokens over none
# memory per rank (bytes): peak of a step 888; at the start of backward parameters 24, gradients 24, AdamW state 48, saved for backward 16, collective buffers 64
# redundant work: 1.00 (forward FLOPs over all ranks / unsharded)
# bytes moved by this rank, inputs without grad: forward 32, backward 80
#   forward all_gather along col: 16
#   forward all_gather along row: 16
#   backward all_gather along col: 16
#   backward all_reduce along depth: 24
#   backward all_reduce along row: 8
#   backward reduce_scatter along row: 32
p_weight = param("weight")  # RS(1)S(0) local [2, 2] float32
p_bias = param("bias")  # RRS(0) local [2] float32
grad_bucket = tess.grad_bucket([p_bias, p_weight], (("depth", "row"), ("depth",)))  # (local [2] float32, local [2, 2] float32) backward all_reduce along depth peers [0, 4] bytes 24 backward all_reduce along row peers [0, 2] bytes 8
p_bias_synced = grad_bucket[0]  # RRS(0) local [2] float32
p_weight_synced = grad_bucket[1]  # RS(1)S(0) local [2, 2] float32
input_1 = input(0)  # RRR local [4, 2, 4] float32
shard_slice = tess.shard_slice(input_1, along="depth", parts=2, dim=0, groups=1)  # local [2, 2, 4] float32 peers [0, 4] bytes 0
shard_slice_1 = tess.shard_slice(shard_slice, along="row", parts=2, dim=0, groups=1)  # local [1, 2, 4] float32 peers [0, 2] bytes 0
shard_slice_2 = tess.shard_slice(shard_slice_1, along="col", parts=2, dim=2, groups=1)  # S(0)S(0)S(2) local [1, 2, 2] float32 peers [0, 1] bytes 0
all_gather = tess.all_gather(p_weight_synced, along="row", parts=2, dim=1, groups=1)  # local [2, 4] float32 peers [0, 2] bytes 16; backward reduce_scatter bytes 32
all_gather_1 = tess.all_gather(shard_slice_2, along="col", parts=2, dim=2, groups=1)  # local [1, 2, 4] float32 peers [0, 1] bytes 16
fetched_product = tess.fetched_product(all_gather_1, all_gather, a_own=shard_slice_2, w_own=p_weight_synced, product="linear", a_fetch=("all_gather", "col", 2, 2, 1), w_fetch=("all_gather", "row", 2, 1, 1))  # local [1, 2, 2] float32 backward all_gather along col peers [0, 1] bytes 16
add = aten.add.Tensor(fetched_product, p_bias_synced)  # S(0)S(0)S(2) local [1, 2, 2] float32
return (add,)
"""

GOLDEN_LINEAR_RANK5 = """\
# tess-compile rewritten graph, mesh [q=2, q=2, d=2], 8 ranks
# rank 5 at (k, i, j) = (1, 0, 1); peers along depth [1, 5], row [5, 7], col [4, 5]
# parameter bytes on this rank: 24
# summa=auto on mesh [q=2, q=2, d=2]: gather for 1 product (priced on the default cluster (CALIBRATED_CLUSTER))
# rows: batch over depth_row, tokens over none
# memory per rank (bytes): peak of a step 888; at the start of backward parameters 24, gradients 24, AdamW state 48, saved for backward 16, collective buffers 64
# redundant work: 1.00 (forward FLOPs over all ranks / unsharded)
# bytes moved by this rank, inputs without grad: forward 32, backward 80
#   forward all_gather along col: 16
#   forward all_gather along row: 16
#   backward all_gather along col: 16
#   backward all_reduce along depth: 24
#   backward all_reduce along row: 8
#   backward reduce_scatter along row: 32
p_weight = param("weight")  # RS(1)S(0) local [2, 2] float32
p_bias = param("bias")  # RRS(0) local [2] float32
grad_bucket = tess.grad_bucket([p_bias, p_weight], (("depth", "row"), ("depth",)))  # (local [2] float32, local [2, 2] float32) backward all_reduce along depth peers [1, 5] bytes 24 backward all_reduce along row peers [5, 7] bytes 8
p_bias_synced = grad_bucket[0]  # RRS(0) local [2] float32
p_weight_synced = grad_bucket[1]  # RS(1)S(0) local [2, 2] float32
input_1 = input(0)  # RRR local [4, 2, 4] float32
shard_slice = tess.shard_slice(input_1, along="depth", parts=2, dim=0, groups=1)  # local [2, 2, 4] float32 peers [1, 5] bytes 0
shard_slice_1 = tess.shard_slice(shard_slice, along="row", parts=2, dim=0, groups=1)  # local [1, 2, 4] float32 peers [5, 7] bytes 0
shard_slice_2 = tess.shard_slice(shard_slice_1, along="col", parts=2, dim=2, groups=1)  # S(0)S(0)S(2) local [1, 2, 2] float32 peers [4, 5] bytes 0
all_gather = tess.all_gather(p_weight_synced, along="row", parts=2, dim=1, groups=1)  # local [2, 4] float32 peers [5, 7] bytes 16; backward reduce_scatter bytes 32
all_gather_1 = tess.all_gather(shard_slice_2, along="col", parts=2, dim=2, groups=1)  # local [1, 2, 4] float32 peers [4, 5] bytes 16
fetched_product = tess.fetched_product(all_gather_1, all_gather, a_own=shard_slice_2, w_own=p_weight_synced, product="linear", a_fetch=("all_gather", "col", 2, 2, 1), w_fetch=("all_gather", "row", 2, 1, 1))  # local [1, 2, 2] float32 backward all_gather along col peers [4, 5] bytes 16
add = aten.add.Tensor(fetched_product, p_bias_synced)  # S(0)S(0)S(2) local [1, 2, 2] float32
return (add,)
"""


def _check_golden(name: str, actual: str) -> None:
    """Compare with the literal GOLDEN_<name> above; TESS_UPDATE_GOLDEN=1 rewrites it."""
    if os.environ.get("TESS_UPDATE_GOLDEN") == "1":
        path = Path(__file__)
        literal = f'GOLDEN_{name} = """\\\n{actual}"""'
        pattern = re.compile(rf'^GOLDEN_{name} = """.*?"""', re.S | re.M)
        path.write_text(pattern.sub(lambda _: literal, path.read_text(), count=1))
        return
    expected = globals()[f"GOLDEN_{name}"]
    assert actual == expected, f"the dump changed; if on purpose, rerun with TESS_UPDATE_GOLDEN=1:\n{actual}"


@pytest.mark.parametrize("rank", [0, 5])
def test_golden_text_dump(rank):
    text = dump(nn.Linear(4, 4), 2, 2, example_inputs=(torch.randn(4, 2, 4),), rank=rank)
    _check_golden(f"LINEAR_RANK{rank}", text)


def _header_bytes(text: str) -> dict[str, int]:
    found = re.search(r"inputs without grad: forward (\d+), backward (\d+)", text)
    return {"forward": int(found.group(1)), "backward": int(found.group(2))}


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2), (3, 3)], ids=[mesh_id(2, 1), mesh_id(2, 2), mesh_id(3, 3)])
@pytest.mark.parametrize("block", [GPTBlock, LlamaBlock], ids=["gpt", "llama"])
def test_header_bytes_equal_bytes_moved(block, q, d):
    torch.manual_seed(0)
    model = block(4 * q, q)
    x = torch.randn(2 * q * d, 3, 4 * q)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,))
    sim(x).square().sum().backward()
    moved = bytes_from_records(sim.comm.records)
    totals = {phase: sum(moved[phase].values()) for phase in ("forward", "backward")}
    assert _header_bytes(dump_program(sim.program, rank=3 % sim.mesh.num_ranks)) == totals
    assert predict_bytes(sim.program) == moved


@pytest.mark.parametrize("q, d", [(2, 2), (3, 1)], ids=[mesh_id(2, 2), mesh_id(3, 1)])
def test_predicted_bytes_with_input_gradients(q, d):
    torch.manual_seed(0)
    model = GPTBlock(4 * q, q)
    x = torch.randn(2 * q * d, 3, 4 * q, requires_grad=True)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,))
    sim(x).square().sum().backward()
    assert predict_bytes(sim.program, inputs_require_grad=True) == bytes_from_records(sim.comm.records)


def test_captured_and_placed_stages():
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    x = torch.randn(4, 2, 4)
    captured = dump(model, 2, 2, example_inputs=(x,), stage="captured")
    placed = dump(model, 2, 2, example_inputs=(x,), stage="placed")
    body = [line for line in captured.splitlines() if not line.startswith("#")]
    assert len(body) == 8, "one line a node: 4 parameters, the input, layer_norm, linear, return"
    assert "layer_norm = aten.layer_norm(" in captured
    assert "S(0)S(0)S(2) local [1, 2, 2]" in placed and "RS(1)S(0) local [2, 2]" in placed


def test_replicated_ops_are_listed_with_their_cost():
    class Flip(nn.Module):
        def forward(self, x):
            return torch.flip(x, [1])

    with pytest.warns(UserWarning, match="no sharding rule"):
        text = dump(Flip(), 2, 1, example_inputs=(torch.randn(2, 3, 4),))
    assert "runs replicated (no sharding rule):" in text
    assert "aten.flip" in text and "output 96 bytes on every rank" in text


class LinearThenTensordot(nn.Module):
    """A linear (split over the ranks), then a product with no sharding rule (run whole on every rank)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.tensordot(y, y, dims=([2], [2]))


def test_redundant_work_in_the_header():
    """x [4, 3, 8] at [2, 2, 1]: the linear's 2*4*3*8*8 = 1536 FLOPs are split over the 4 ranks, the
    tensordot's 2*12*12*8 = 2304 run on each: (1536 + 4 * 2304) / (1536 + 2304) = 2.80."""
    with pytest.warns(UserWarning, match="no sharding rule"):
        text = dump(LinearThenTensordot(), 2, 1, example_inputs=(torch.randn(4, 3, 8),))
    assert "# redundant work: 2.80 (forward FLOPs over all ranks / unsharded)" in text.splitlines(), text


def test_dot_format_and_svg():
    model, x = nn.Linear(4, 4), torch.randn(4, 2, 4)
    dot = dump(model, 2, 2, example_inputs=(x,), format="dot")
    assert dot.startswith("digraph")
    assert "all_gather" in dot and dot.count("->") >= 10
    if shutil.which("dot") is None:
        with pytest.raises(ValueError, match="Graphviz"):
            dump(model, 2, 2, example_inputs=(x,), format="svg")
    else:
        svg = dump(model, 2, 2, example_inputs=(x,), format="svg")
        assert svg.lstrip().startswith(("<svg", "<?xml"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stage": "lowered"}, "stage 'lowered' is not one of"),
        ({"format": "png"}, "format 'png' is not one of"),
        ({"rank": 8}, "rank 8"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        dump(nn.Linear(4, 4), 2, 2, example_inputs=(torch.randn(4, 2, 4),), **options)


def test_accounting_of_flags_and_weights_given_as_inputs():
    """A flag input passes through the fake run; on the torch.compile path, weights
    arrive as inputs and still count as requiring grad, as the runtime treats them."""

    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale: bool = False):
            return self.lin(x) * 2 if scale else self.lin(x)

    x = torch.randn(4, 2, 4)
    assert "tess.all_gather" in dump(Flagged(), 2, 2, example_inputs={"x": x, "scale": False})

    torch._dynamo.reset()
    programs = []

    def capture_backend(gm, example_inputs):
        compiled = tess_compile.backend(2, 2, simulate=True)(gm, example_inputs)
        programs.append(compiled)
        return compiled

    model = nn.Linear(4, 4)
    torch.compile(model, backend=capture_backend)(x).square().sum().backward()
    sim = programs[0]
    assert predict_bytes(sim.program) == bytes_from_records(sim.comm.records)
