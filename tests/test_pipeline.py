"""Pipeline parallelism: tess-sharded stages, over torch.distributed.pipelining and in simulation.

The model is a small language model cut in two: stage 0 is the token and
position embeddings and a Llama block, stage 1 a Llama block, an RMSNorm and
the vocabulary head. No biases: a key bias has an exactly-zero gradient
whose rounding noise AdamW would amplify into order-lr steps, which no
comparison at 1e-12 survives. Everything runs in float64 and is compared
with the unsharded model (`nn.Sequential` of the two stages) on the whole
batch: the losses, every gradient and the weights after AdamW steps.

One launch of 8 gloo processes runs 2 stages x [2, 2, 1] with both
schedules (GPipe with 2 microbatches, 1F1B with 4), data parallel 2 x
2 stages x 1-D p=2 on a ("dp", "pp", "depth", "row", "col") mesh, and the
bad-input checks; the simulation tests run every rank of every stage in this
process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import LlamaBlock
from torch import nn

import tess_compile
from tess_compile.core.layout import Layout, R, Shard, local_block
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.runtime.launch import run_local
from tess_compile.scale_out.simulated_pipeline import simulate_pipeline
from tess_compile.scale_out.stage_ports import Port, StagePorts, check_boundaries, stage_ports

VOCAB, HIDDEN, HEADS, SEQ = 16, 8, 2, 4
TOL = 1e-12
STEPS = 3
LR = 1e-2


class Embed(nn.Module):
    """Stage 0: token and position embeddings, then a Llama block; returns hidden states [b, s, h]."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(SEQ, HIDDEN)
        self.block = LlamaBlock(HIDDEN, HEADS)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.block(x)


class Head(nn.Module):
    """Stage 1: a Llama block, an RMSNorm and the vocabulary head; returns logits [b, s, V]."""

    def __init__(self):
        super().__init__()
        self.block = LlamaBlock(HIDDEN, HEADS)
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.block(x)))


def make_case(batch: int, seed: int = 5):
    """The unsharded model (two stages), token ids and targets, the same on every rank."""
    torch.manual_seed(seed)
    model = nn.Sequential(Embed(), Head()).double()
    with torch.no_grad():  # norm weights start at ones: make every tensor distinct
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    targets = torch.randint(0, VOCAB, (batch, SEQ))
    return model, ids, targets


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over the largest |expected| (inf on a shape mismatch or NaN)."""
    if actual is None or tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs().max().item()
    return float("inf") if err != err else err / max(e.abs().max().item(), 1e-12)


def error_text(call) -> str:
    """The ValueError message of `call()`, or a description of what happened instead."""
    try:
        call()
    except ValueError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001  (reported to the parent, which fails the test)
        return f"UNEXPECTED {type(err).__name__}: {err}"
    return "UNEXPECTED: no error"


# ---------------------------------------------------------------------------
# Over 8 gloo processes: 2 stages x [2, 2, 1]
# ---------------------------------------------------------------------------


def _train_one_schedule(rank, q, d, schedule_name, microbatches, dp=1, mode="2.5d"):
    """AdamW steps of the pipelined model (2 stages, data parallel over `dp` groups) beside the
    oracle on the whole batch; this rank's errors and losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    num_stages = 2
    mesh = Mesh(q, d, mode)
    if dp == 1:  # the default mesh: stage s is ranks s*q*q*d onwards
        root, stage_index, group = None, rank // mesh.num_ranks, 0
    else:
        root = init_device_mesh("cpu", (dp, num_stages, *mesh.shape), mesh_dim_names=("dp", "pp", *AXES))
        stage_index, group = root.get_local_rank("pp"), root.get_local_rank("dp")
    parts = d * q if mode != "1d" else 1
    group_batch = microbatches * parts * (2 if mode == "1d" else 1)
    model, ids, targets = make_case(dp * group_batch)
    oracle = copy.deepcopy(model)
    mine = slice(group * group_batch, (group + 1) * group_batch)  # this data-parallel group's batch
    mb = group_batch // microbatches
    example = (ids[:mb],) if stage_index == 0 else (torch.zeros(mb, SEQ, HIDDEN, dtype=torch.float64),)
    stage = tess_compile.pipeline_stage(copy.deepcopy(model[stage_index]), q, d, stage_index, num_stages,
                                        example_inputs=example, mesh=root, mode=mode, timeout=120)
    sharded = stage.submod

    def loss_fn(logits, y):  # the last stage returns DTensors: gather the logits, as with shard()
        return lm_loss(tess_compile.full_tensor(logits), y)

    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_cls(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR, foreach=True)
    oracle_opt = torch.optim.AdamW(oracle.parameters(), lr=LR, foreach=True)
    out = {"errors": {}, "losses": [], "oracle_losses": [], "stage": stage_index, "layouts": set()}
    prefix = f"{stage_index}."
    tp_rank = sharded.world.rank  # this rank's (k, i, j) in its stage
    for step in range(STEPS):
        opt.zero_grad()
        oracle_opt.zero_grad()
        with torch.no_grad():
            expected = lm_loss(oracle(ids[mine]), targets[mine])  # this group's loss
        lm_loss(oracle(ids), targets).backward()  # the step: the mean over the whole batch
        if stage_index == 0:
            schedule.step(ids[mine])
        else:
            losses = []
            schedule.step(target=targets[mine], losses=losses)
            # Each microbatch's loss is the mean over its microbatch; the schedule divides
            # the gradients by the number of microbatches (scale_grads=True).
            out["losses"].append(torch.stack([x.detach() for x in losses]).mean().item())
            out["oracle_losses"].append(expected.item())
        for slot in sharded.program.params:
            full_grad = dict(oracle.named_parameters())[prefix + slot.name].grad
            grad = sharded.get_parameter(slot.name).grad
            out["errors"][f"step {step} grad {slot.name}"] = rel_err(
                None if grad is None else grad.to_local(), local_block(full_grad, slot.layout, mesh, tp_rank)
            )
        opt.step()
        oracle_opt.step()
    for slot in sharded.program.params:
        full = dict(oracle.named_parameters())[prefix + slot.name]
        out["errors"][f"weight {slot.name}"] = rel_err(
            sharded.get_parameter(slot.name).to_local(), local_block(full.detach(), slot.layout, mesh, tp_rank)
        )
    out["layouts"] = {str(p.layout) for p in stage_ports(sharded.program, stage_index, num_stages).outputs}
    return out


def _pipeline_worker(rank, world_size, q, d):
    torch.set_num_threads(1)
    result = {
        "gpipe": _train_one_schedule(rank, q, d, "gpipe", 2),
        "1f1b": _train_one_schedule(rank, q, d, "1f1b", 4),
        # Data parallel 2 x pipeline 2 x 1-D p=2 on the mesh ("dp", "pp", "depth", "row", "col").
        "dp2-1d": _train_one_schedule(rank, 1, 2, "gpipe", 2, dp=2, mode="1d"),
    }
    # Bad input: refused on every rank, before any module is built.
    mesh = Mesh(q, d)
    stage_index = rank // mesh.num_ranks
    model, ids, _ = make_case(2 * d * q)
    mb = d * q
    wrong = (ids[:mb],) if stage_index == 0 else (torch.zeros(2 * mb, SEQ, HIDDEN, dtype=torch.float64),)
    result["boundary"] = error_text(lambda: tess_compile.pipeline_stage(
        model[stage_index], q, d, stage_index, 2, example_inputs=wrong))
    result["stage_index"] = error_text(lambda: tess_compile.pipeline_stage(
        model[stage_index], q, d, 1 - stage_index, 2, example_inputs=wrong))
    result["world"] = error_text(lambda: tess_compile.pipeline_stage(
        model[0], q, d, 0, 3, example_inputs=(ids[:mb],)))
    return result


@pytest.mark.slow
def test_pipeline_two_stages_over_gloo_is_exact():
    q, d = 2, 1
    results = run_local(_pipeline_worker, 8, args=(q, d), timeout_s=600, collective_timeout_s=180)
    for rank, res in enumerate(results):
        stage = rank // 4
        for schedule in ("gpipe", "1f1b", "dp2-1d"):
            run = res[schedule]
            assert run["stage"] == (stage if schedule != "dp2-1d" else (rank // 2) % 2)
            bad = {name: err for name, err in run["errors"].items() if not err <= TOL}
            assert not bad, f"rank {rank} (stage {stage}) {schedule}: beyond {TOL}: {bad}"
            assert len(run["errors"]) > 10, f"rank {rank} {schedule}: too few checks {sorted(run['errors'])}"
            if run["stage"] == 1:
                assert len(run["losses"]) == STEPS
                for got, expected in zip(run["losses"], run["oracle_losses"]):
                    assert abs(got - expected) <= TOL * abs(expected), f"rank {rank} {schedule}: {got} != {expected}"
            elif schedule != "dp2-1d":  # what stage 0 sends: hidden states, batch over (depth, row), hidden over col
                assert run["layouts"] == {"S(0)S(0)S(2)"}, run["layouts"]
            else:  # in 1-D, Megatron-LM's sequence-parallel activations: each rank's tokens
                assert run["layouts"] == {"RRS(1)"}, run["layouts"]
        msg = res["boundary"]
        assert "UNEXPECTED" not in msg, f"rank {rank}: {msg}"
        assert "stage 0" in msg and "stage 1" in msg and "[2, 4, 8]" in msg and "[4, 4, 8]" in msg, msg
        assert "example_inputs" in msg, msg
        msg = res["stage_index"]
        assert f"stage {stage}" in msg and f"stage_index={1 - stage}" in msg and f"pass stage_index={stage}" in msg, msg
        msg = res["world"]
        assert "world size 8" in msg and "12" in msg, msg


# ---------------------------------------------------------------------------
# In simulation: every rank of every stage in this process
# ---------------------------------------------------------------------------


def _train_simulated(q: int, d: int, microbatches: int, dp: int = 1, mode: str = "2.5d"):
    """AdamW steps of a simulated pipeline (data parallel over `dp` groups) beside the oracle;
    the largest relative error of the losses, gradients and weights."""
    batch = dp * microbatches * d * q if mode != "1d" else dp * microbatches * 2
    model, ids, targets = make_case(batch)
    oracle = copy.deepcopy(model)
    sim = simulate_pipeline(list(copy.deepcopy(model)), q, d, example_inputs=(ids,), microbatches=microbatches,
                            dp=dp, mode=mode)
    opt = torch.optim.AdamW(sim.parameters(), lr=LR, foreach=True)
    oracle_opt = torch.optim.AdamW(oracle.parameters(), lr=LR, foreach=True)
    errors = {}
    for step in range(STEPS):
        opt.zero_grad()
        oracle_opt.zero_grad()
        loss = lm_loss(sim(ids), targets)
        expected = lm_loss(oracle(ids), targets)
        loss.backward()
        expected.backward()
        errors[f"step {step} loss"] = rel_err(loss, expected)
        grads = sim.full_grads()
        for name, param in oracle.named_parameters():
            errors[f"step {step} grad {name}"] = rel_err(grads[name], param.grad)
        opt.step()
        oracle_opt.step()
    weights = sim.full_state_dict()
    for name, value in oracle.state_dict().items():
        errors[f"weight {name}"] = rel_err(weights[name], value)
    return sim, errors


@pytest.mark.parametrize("q, d, microbatches", [(2, 2, 2), (2, 1, 4)], ids=["pp2-q2d2-mb2", "pp2-q2d1-mb4"])
def test_simulated_pipeline_is_exact(q, d, microbatches):
    sim, errors = _train_simulated(q, d, microbatches)
    bad = {name: err for name, err in errors.items() if not err <= TOL}
    assert not bad, f"beyond {TOL}: {bad}"
    # Between the stages nothing is gathered: stage 1's first collectives are its own block's.
    assert len(sim.stages) == 2
    first = sim.stages[1].program
    local = [s for s in first.slots if s.role == "local input"]
    assert [str(s.layout) for s in local] == ["S(0)S(0)S(2)"]


def test_figure_6_dp2_pp2_q2d2_in_simulation_is_exact():
    """The Tesseract paper's Figure 6: data parallel 2 x pipeline 2 x [2, 2, 2] = 32 ranks."""
    sim, errors = _train_simulated(2, 2, 2, dp=2)
    bad = {name: err for name, err in errors.items() if not err <= TOL}
    assert not bad, f"beyond {TOL}: {bad}"
    assert sim.num_groups == 2 and all(len(group.stages) == 2 for group in sim.replicas)
    assert sum(stage.mesh.num_ranks for group in sim.replicas for stage in group.stages) == 32


def test_simulated_pipeline_in_1d_mode_is_exact():
    """Megatron's replicated activations cross the boundary as replicas; their gradient shares add up."""
    _, errors = _train_simulated(1, 2, 2, mode="1d")
    bad = {name: err for name, err in errors.items() if not err <= TOL}
    assert not bad, f"beyond {TOL}: {bad}"


def test_split_that_does_not_match_is_refused_in_simulation():
    model, ids, _ = make_case(8)
    wide = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)).double()
    stages = [nn.Sequential(model[0], wide), model[1]]  # stage 0 returns [b, s, 2h]; stage 1 takes [b, s, h]
    with pytest.raises(ValueError) as info:
        simulate_pipeline(stages, 2, 2, example_inputs=(ids,), microbatches=2)
    msg = str(info.value)
    assert "stage 0" in msg and "stage 1" in msg and "[4, 4, 16]" in msg and "S(0)S(0)S(2)" in msg, msg
    assert "cut the model where stage 0's outputs are exactly stage 1's positional inputs" in msg, msg

    with pytest.raises(ValueError, match="does not split into 3 equal microbatches"):
        simulate_pipeline(list(model), 2, 2, example_inputs=(ids,), microbatches=3)


def test_check_boundaries_names_stages_shapes_and_fix():
    mesh = Mesh(2, 2)
    hidden = Layout(Shard(0), Shard(0), Shard(2))
    port = Port((4, 4, 8), torch.float64, hidden)
    ok = [StagePorts(0, mesh, (), (port,)), StagePorts(1, mesh, (port,), (port,)), StagePorts(2, mesh, (port,), ())]
    check_boundaries(ok)

    other = Port((4, 4, 8), torch.float32, hidden)
    with pytest.raises(ValueError) as info:
        check_boundaries([ok[0], StagePorts(1, mesh, (other,), (port,))])
    msg = str(info.value)
    assert "stage 0's output 0 is [4, 4, 8] float64 in layout S(0)S(0)S(2) (blocks [1, 4, 4])" in msg, msg
    assert "stage 1's input 0 is [4, 4, 8] float32" in msg and "example_inputs" in msg, msg

    with pytest.raises(ValueError, match=r"stage 1 returns 1 tensor\(s\) .* but stage 2 takes 2 positional input"):
        check_boundaries([ok[0], ok[1], StagePorts(2, mesh, (port, port), ())])
    with pytest.raises(ValueError, match=r"stage 0 runs on mesh \[q=2, q=2, d=2\] and stage 1 on mesh \[q=2, q=2, d=1\]"):
        check_boundaries([ok[0], StagePorts(1, Mesh(2, 1), (Port((4, 4, 8), torch.float64, hidden),), ())])
    with pytest.raises(ValueError, match="stage 0 .* cannot be a stage: it returns a nested structure"):
        check_boundaries([StagePorts(0, mesh, (), (port,), "it returns a nested structure, not a tensor or a flat "
                                                           "tuple of tensors"), ok[1]])
    replicated = Port((4, 4), torch.int64, Layout(Shard(0), Shard(0), R))
    assert replicated.describe(mesh) == "[4, 4] int64 in layout S(0)S(0)R (blocks [1, 4])"


@pytest.mark.slow
def test_train_pipeline_example_simulated():
    """examples/train_pipeline.py --simulate: one table row per step, losses beside the unsharded model's."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["--simulate", "--steps", "2", "--hidden", "16", "--heads", "2", "--vocab", "32", "--seq", "8"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "train_pipeline.py"), *flags], cwd=root,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    row = re.compile(r"^\s*(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(\d\.\d+e[+-]\d+)\s*$")
    rows = [m.groups() for m in map(row.match, proc.stdout.splitlines()) if m]
    assert [int(r[0]) for r in rows] == [1, 2], report
    assert all(float(r[3]) < 1e-4 for r in rows), report
    assert "max abs diff" in proc.stdout.splitlines()[-1], report
