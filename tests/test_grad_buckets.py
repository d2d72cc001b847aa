"""Gradient buckets (passes/bucket_gradients.py, tess_compile/ops/grad_bucket.py).

The gradients of the parameters replicated over an axis are all-reduced
together: one collective per axis (and dtype) for each bucket, instead of
one per parameter and axis. The sums are those of per-parameter syncs, so
every gradient still equals the unsharded model's (float64, 1e-12); a
bucket of 1 byte puts each parameter in its own bucket, filled last-used
first.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_matches_model
from models import GPTBlock

import tess_compile
from tess_compile.passes import bucket_gradients
from tess_compile.ops.grad_bucket import grad_bucket

Q, D, HIDDEN, HEADS = 2, 2, 8, 4


def _block_and_input():
    torch.manual_seed(0)
    model = GPTBlock(HIDDEN, HEADS).to(torch.float64)
    return model, torch.randn(Q * Q * D, 4, HIDDEN, dtype=torch.float64)


def _bucket_nodes(sim) -> list[torch.fx.Node]:
    return [n for n in sim.program.graph.graph.nodes if n.target is grad_bucket]


def test_one_all_reduce_per_axis_for_a_block():
    """A GPT block: 4 weights (replicated over depth) and 8 biases and norm vectors (over row
    and depth): 20 all-reduces one by one, 2 in one bucket."""
    model, x = _block_and_input()
    sim = tess_compile.simulate(copy.deepcopy(model), Q, D, example_inputs=(x,), verify=True)
    (bucket,) = _bucket_nodes(sim)
    assert len(bucket.args[0]) == 12
    assert_matches_model(sim, model, x, rtol=1e-12)
    backward = sim.comm.counts("backward")
    assert backward[("all_reduce", "depth")] == 1
    assert backward[("all_reduce", "row")] == 1


def test_small_buckets_fill_last_used_first(monkeypatch):
    monkeypatch.setattr(bucket_gradients, "BUCKET_BYTES", 1)
    model, x = _block_and_input()
    sim = tess_compile.simulate(copy.deepcopy(model), Q, D, example_inputs=(x,), verify=True)
    nodes = _bucket_nodes(sim)
    assert [len(n.args[0]) for n in nodes] == [1] * 12
    names = [n.args[0][0].meta["global_node"] for n in nodes]
    assert names[0] == "p_mlp_proj_bias" and names[-1] in ("p_ln1_weight", "p_ln1_bias"), names  # backward's order
    assert_matches_model(sim, model, x, rtol=1e-12)
    backward = sim.comm.counts("backward")
    assert backward[("all_reduce", "depth")] == 12
    assert backward[("all_reduce", "row")] == 8


def test_frozen_parameters_are_left_out():
    """A parameter that does not require grad is not reduced; the others still are, exactly."""
    model, x = _block_and_input()
    sim = tess_compile.simulate(copy.deepcopy(model), Q, D, example_inputs=(x,), verify=True)
    for name, param in sim.named_parameters():
        if "ln1" in name:
            param.requires_grad_(False)
    model.ln1.requires_grad_(False)
    sim(x).square().sum().backward()
    model(x).square().sum().backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-12, atol=1e-12, msg=name)
    # the vectors (biases, norm weights) are split over col: [n/q] float64 on each rank
    vectors = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1 and "ln1" not in n) // Q * 8
    row = [r.num_bytes for r in sim.comm.records if r.phase == "backward" and r.op == "all_reduce" and r.axis == "row"]
    assert row == [vectors], "the two vectors of ln1 are left out of the bucket"


def test_gradients_accumulate_over_steps():
    """Two backward passes without zero_grad: each bucket reduces only its own step's shares."""
    model, x = _block_and_input()
    sim = tess_compile.simulate(copy.deepcopy(model), Q, D, example_inputs=(x,), verify=True)
    for _ in range(2):
        sim(x).square().sum().backward()
        model(x).square().sum().backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["2.5d", "1d"])
def test_distributed_buckets_match_the_simulator(mode):
    """Over gloo (4 processes) the bucketed gradients equal the simulator's, collective for collective."""
    from tess_compile.runtime.launch import run_local

    q, d = (2, 1) if mode == "2.5d" else (1, 4)
    results = run_local(_distributed_step, 4, args=(mode, q, d), timeout_s=300)
    sim_grads, sim_counts = _simulated_step(mode, q, d)
    grads, counts = results[0]
    assert counts == sim_counts
    for name, grad in sim_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)


def _simulated_step(mode: str, q: int, d: int):
    model, x = _block_and_input()
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode)
    sim(x).square().sum().backward()
    return sim.full_grads(), sim.comm.counts("backward")


def _distributed_step(rank: int, world_size: int, mode: str, q: int, d: int):
    model, x = _block_and_input()
    sharded = tess_compile.shard(model, q, d, example_inputs=(x,), mode=mode, timeout=120)
    sharded(x).square().sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    return grads, sharded.comm.counts("backward")


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.used = torch.nn.Linear(HIDDEN, HIDDEN)
        self.unused = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        y = self.norm(x)
        return self.used(y), self.unused(y)


def test_parameters_backward_does_not_reach_keep_no_gradient():
    """As in PyTorch: the head the loss does not use gets no gradient (None, not zeros, which
    AdamW would decay), while its bucket still runs the same collectives on every rank."""
    torch.manual_seed(0)
    model = _TwoHeads().to(torch.float64)
    x = torch.randn(Q * Q * D, 4, HIDDEN, dtype=torch.float64)
    sim = tess_compile.simulate(copy.deepcopy(model), Q, D, example_inputs=(x,), verify=True)
    sim(x)[0].square().sum().backward()
    model(x)[0].square().sum().backward()
    for name, param in sim.named_parameters():
        assert (param.grad is None) == ("unused" in name), name
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-12, atol=1e-12, msg=name)
