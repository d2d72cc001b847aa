"""Exact collective counts and sizes per phase (DESIGN.md section 3), in the papers'
schedule (summa="broadcast"; tests/test_schedules.py counts the others).

Expectations are derived from the algorithms, not read off the library:

- `Y = X @ W^T` by Tesseract's SUMMA: q steps, each a broadcast of the X
  block along col and of the W block along row (forward). Backward keeps
  only the own blocks and broadcasts them again (dX needs W's blocks, dW
  X's: q each along row and col), and the forward broadcasts' adjoints
  are reduces: dX reduces along col, dW along row (q each). W is
  replicated over depth, so dW is then all-reduced along depth. With
  `keep_blocks=True` the backward broadcasts are not made.
- A bias (R R S(0)) is replicated over row and depth: its gradient is
  all-reduced along row and depth.
- The gradients of all replicated parameters are bucketed
  (`tess_compile.passes.bucket_gradients`): one all-reduce per axis for the whole model here.
- LayerNorm over the col-split hidden dim: one all-gather along col of each
  rank's mean and centred sum of squares (two numbers a row); backward
  all-reduces its two sums along col together, once.
- Axes of size 1 emit nothing.

One record per collective call; num_bytes is one rank's local tensor.
"""

from __future__ import annotations

import pytest
import torch
from models import make_block, mesh_id
from torch import nn

import tess_compile

F32 = 4  # bytes per element
LINEAR_MESHES = [(2, 1), (2, 2), (3, 3), (4, 2)]
SEQ = 3


def run(model: nn.Module, q: int, d: int, hidden: int, *, input_grad: bool = True, keep_blocks: bool = False):
    """Simulate `model` on a [d*q, SEQ, hidden] input, forward and backward; return the sim."""
    x = torch.randn(d * q, SEQ, hidden)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), strict=True, verify=True, keep_blocks=keep_blocks,
                                summa="broadcast")
    assert sim.comm.records == [], "compiling must not communicate"
    out = sim(x.clone().requires_grad_(input_grad))
    forward_records = len(sim.comm.records)
    assert all(r.phase == "forward" for r in sim.comm.records)
    (out * torch.randn_like(out)).sum().backward()
    assert all(r.phase == "backward" for r in sim.comm.records[forward_records:])
    return sim


def bytes_by_key(sim, phase: str) -> dict[tuple[str, str], set[int]]:
    out: dict[tuple[str, str], set[int]] = {}
    for record in sim.comm.records:
        if record.phase == phase:
            out.setdefault((record.op, record.axis), set()).add(record.num_bytes)
    return out


def with_depth(counts: dict, d: int) -> dict:
    """`counts` and, with d > 1, the one bucketed all-reduce along depth of the gradients of
    the parameters replicated over depth."""
    if d > 1:
        counts[("all_reduce", "depth")] = 1
    return counts


@pytest.mark.parametrize("q, d", LINEAR_MESHES, ids=[mesh_id(q, d) for q, d in LINEAR_MESHES])
def test_linear_no_bias_counts(q, d):
    hidden = 4 * q
    sim = run(nn.Linear(hidden, hidden, bias=False), q, d, hidden)
    fetches = {("broadcast", "col"): q, ("broadcast", "row"): q}
    assert sim.comm.counts("forward") == fetches
    assert sim.comm.counts("backward") == with_depth({("reduce", "col"): q, ("reduce", "row"): q, **fetches}, d)

    local_batch = 1  # the input's batch is d*q
    activation = local_batch * SEQ * (hidden // q) * F32  # [b/(d*q), s, h/q]
    weight = (hidden // q) * (hidden // q) * F32  # [h/q, h/q]
    blocks = {("broadcast", "col"): {activation}, ("broadcast", "row"): {weight}}
    assert bytes_by_key(sim, "forward") == blocks
    assert bytes_by_key(sim, "backward") == with_depth(
        {("reduce", "col"): {activation}, ("reduce", "row"): {weight}, **blocks}, d
    ) | ({("all_reduce", "depth"): {weight}} if d > 1 else {})


@pytest.mark.parametrize("q, d", LINEAR_MESHES, ids=[mesh_id(q, d) for q, d in LINEAR_MESHES])
def test_linear_keeping_blocks_skips_backward_broadcasts(q, d):
    hidden = 4 * q
    sim = run(nn.Linear(hidden, hidden, bias=False), q, d, hidden, keep_blocks=True)
    assert sim.comm.counts("forward") == {("broadcast", "col"): q, ("broadcast", "row"): q}
    assert sim.comm.counts("backward") == with_depth({("reduce", "col"): q, ("reduce", "row"): q}, d)


@pytest.mark.parametrize("q, d", LINEAR_MESHES, ids=[mesh_id(q, d) for q, d in LINEAR_MESHES])
def test_linear_with_bias_counts(q, d):
    hidden = 4 * q
    sim = run(nn.Linear(hidden, hidden, bias=True), q, d, hidden)
    assert sim.comm.counts("forward") == {("broadcast", "col"): q, ("broadcast", "row"): q}
    assert sim.comm.counts("backward") == with_depth(
        {("reduce", "col"): q, ("reduce", "row"): q, ("broadcast", "col"): q, ("broadcast", "row"): q,
         ("all_reduce", "row"): 1}, d
    )
    weight = (hidden // q) ** 2 * F32
    bias = (hidden // q) * F32
    backward = bytes_by_key(sim, "backward")
    assert backward[("all_reduce", "row")] == {bias}
    if d > 1:
        assert backward[("all_reduce", "depth")] == {weight + bias}  # one bucket


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2), (4, 2)], ids=["q2d1", "q2d2", "q4d2"])
def test_linear_input_without_grad_skips_reduce_along_col(q, d):
    """No gradient is asked of the input: dX (the reduces along col, and W's blocks
    fetched again along row) is not computed; dW fetches X's blocks along col."""
    hidden = 4 * q
    sim = run(nn.Linear(hidden, hidden, bias=False), q, d, hidden, input_grad=False)
    assert sim.comm.counts("backward") == with_depth({("reduce", "row"): q, ("broadcast", "col"): q}, d)


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2), (3, 3)], ids=["q2d1", "q2d2", "q3d3"])
def test_layer_norm_counts(q, d):
    hidden = 4 * q
    sim = run(nn.LayerNorm(hidden), q, d, hidden)
    assert sim.comm.counts("forward") == {("all_gather", "col"): 1}
    assert sim.comm.counts("backward") == with_depth({("all_reduce", "col"): 1, ("all_reduce", "row"): 1}, d)
    statistics = 1 * SEQ * 2 * F32  # [b/(d*q), s, 2]: two numbers per row
    vector = (hidden // q) * F32
    assert bytes_by_key(sim, "forward") == {("all_gather", "col"): {statistics}}
    backward = bytes_by_key(sim, "backward")
    assert backward[("all_reduce", "col")] == {statistics}
    assert backward[("all_reduce", "row")] == {2 * vector}  # weight and bias in one bucket


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2)], ids=["q2d1", "q2d2"])
def test_rms_norm_counts(q, d):
    hidden = 4 * q
    sim = run(nn.RMSNorm(hidden), q, d, hidden)
    assert sim.comm.counts("forward") == {("all_reduce", "col"): 1}
    assert sim.comm.counts("backward") == with_depth({("all_reduce", "col"): 1, ("all_reduce", "row"): 1}, d)


def test_single_rank_mesh_sends_nothing():
    sim = run(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), 1, 1, 8)
    assert sim.comm.records == []


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2)], ids=["q2d1", "q2d2"])
def test_counts_accumulate_per_call(q, d):
    """Each forward adds its own records: two calls, twice the counts."""
    hidden = 4 * q
    model = nn.Linear(hidden, hidden, bias=False)
    x = torch.randn(d * q, SEQ, hidden)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), verify=True, summa="broadcast")
    sim(x)
    sim(x)
    assert sim.comm.counts("forward") == {("broadcast", "col"): 2 * q, ("broadcast", "row"): 2 * q}
    assert sim.comm.counts("backward") == {}


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2), (3, 3)], ids=["q2d1", "q2d2", "q3d3"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_block_counts(kind, q, d):
    """A whole block communicates only through its matmuls, norms and replicated-gradient syncs.

    GPT: 4 linears with bias (qkv, proj, fc, proj) and 2 LayerNorms with
    affine; attention, GELU, split and the head views are local.
    Llama: 7 linears without bias (q, k, v, o, gate, up, down) and 2 RMSNorm
    weights (one written by hand: its mean over the split hidden dim is one
    all-reduce along col, like nn.RMSNorm's); the linears of one input are one
    product (`tess_compile.passes.merge_products`): q/k/v, o, gate/up, down.
    """
    hidden = 4 * q
    sim = run(make_block(kind, hidden, q), q, d, hidden)
    num_products = 4  # each a SUMMA loop
    norm_statistics = ("all_gather", "col") if kind == "gpt" else ("all_reduce", "col")  # LayerNorm, RMSNorm
    assert sim.comm.counts("forward") == {
        ("broadcast", "col"): num_products * q,
        ("broadcast", "row"): num_products * q,
        norm_statistics: 2,
    }
    assert sim.comm.counts("backward") == with_depth(
        {
            ("reduce", "col"): num_products * q,
            ("reduce", "row"): num_products * q,
            ("broadcast", "col"): num_products * q,
            ("broadcast", "row"): num_products * q,
            ("all_reduce", "col"): 2,  # one a norm
            ("all_reduce", "row"): 1,  # the biases and norm weights, one bucket
        },
        d,
    )
