"""One parallel spec from plan to launch (`tess_compile.core.parallel_spec`, docs/scale_out.md).

Fast (in this process): the spec's checks and its JSON; the stage cut of a pipeline; every rank of
a spec of 2 replicas of a 2-stage pipeline of [2, 2, 1] simulated, exact in float64 (outputs and
every gradient); the old keywords' FutureWarnings; `tess-compile run --spec FILE --simulate`. The
plan's rows and `--pick` carry their specs: tests/test_cli.py's `plan --json` test.
Slow (gloo processes): examples/train_planned.py end to end (plan, launch 8 processes, train,
checkpoint, resume), a spec with replicas, pipeline stages and ZeRO-3 trains as the unsharded
model, and generation on a spec of 2 replicas with ZeRO-3.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel
from models import TinyGPT
from test_cli import MODEL_PY, check_run, run_in_process

import tess_compile
from tess_compile import CompileOptions, ParallelSpec
from tess_compile.runtime.launch import run_local
from tess_compile.scale_out.rank_run import stage_modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 16, 8, 2, 2, 4


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ).double()


@pytest.mark.parametrize("fields, words", [
    ({"zero": 1}, r"the ZeRO levels are 0 \(none\) and 3"),
    ({"zero": 3}, "ZeRO shards over the data-parallel replicas: pass dp > 1"),
    ({"pp": 2, "microbatches": 1}, "1F1B runs at least as many microbatches as stages"),
    ({"pp": 2, "microbatches": 2, "options": CompileOptions(dynamic=True)}, "pipeline stages compile per shape"),
    ({"dp": True}, "dp is a count"),
    ({"d": 3}, "d=3 > q=2"),
    ({"schedule": "zb"}, "use one of 1f1b, gpipe"),
    ({"dp": 4, "zero_shard": 2}, "HSDP shards ZeRO-3 over groups of zero_shard replicas"),
    ({"dp": 4, "zero": 3, "zero_shard": 4}, r"a divisor of dp between 1 and dp: pass zero=3"),
])
def test_a_spec_checks_its_fields(fields, words):
    with pytest.raises(ValueError, match=words):
        ParallelSpec(**{"q": 2, "d": 1, **fields})


def test_a_spec_round_trips_through_json(tmp_path):
    spec = ParallelSpec(1, 4, dp=2, zero=3, pp=2, schedule="gpipe", microbatches=4,
                        options=CompileOptions(mode="1d", recompute="blocks"))
    assert spec.world_size == 16 and spec.describe() == "dp 2 x pp 2 x 1-D [p=4] (gpipe, 4 microbatches), ZeRO-3"
    spec.save(tmp_path / "spec.json")
    assert ParallelSpec.load(tmp_path / "spec.json") == spec == ParallelSpec.from_dict(spec.to_dict())
    with pytest.raises(ValueError, match=r"unknown keys \['tp'\] in a parallel spec"):
        ParallelSpec.from_dict({"q": 2, "tp": 4})
    hsdp = ParallelSpec(2, 1, dp=8, zero=3, zero_shard=4)
    assert hsdp.describe() == "dp 8 x pp 1 x 2.5d [q=2, q=2, d=1], HSDP (2 replicas of ZeRO-3 over 4)"
    assert ParallelSpec.from_dict(hsdp.to_dict()) == hsdp
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad.json. is not a parallel spec \(a parallel spec is a JSON object"):
        ParallelSpec.load(tmp_path / "bad.json")


def test_a_pipeline_cuts_the_repeated_blocks_evenly():
    model, ids = tiny_gpt(), torch.randint(0, VOCAB, (2, SEQ))
    first, last = stage_modules(model, 2, (ids,))
    assert [name for name, _ in first.named_parameters()][-1].startswith("blocks.0.")
    assert [name for name, _ in last.named_parameters()][0].startswith("blocks.1.")
    assert torch.equal(last(first(ids)), model(ids))
    with pytest.raises(ValueError, match="pp=3 stages do not split the 2 repeated blocks of TinyGPT evenly"):
        stage_modules(model, 3, (ids,))


def test_a_spec_of_replicas_and_stages_is_simulated_exactly():
    """Every rank of dp 2 x pp 2 x [2, 2, 1] (16) in this process, the model cut as `parallelize` cuts it."""
    spec = ParallelSpec(2, 1, dp=2, pp=2, microbatches=2)
    model, ids = tiny_gpt(), torch.randint(0, VOCAB, (8, SEQ))
    sim = tess_compile.simulate(copy.deepcopy(model), spec=spec, example_inputs=(ids,))
    out, expected = sim(ids), model(ids)
    assert_close_rel(out, expected, 1e-12, "output")
    weights = torch.randn(expected.shape, dtype=torch.float64)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    grads = {name.split(".", 1)[1]: grad for name, grad in sim.full_grads().items()}  # "<stage>.<name>"
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name}")
    with pytest.raises(TypeError, match="got spec= beside q, d, dp or compile options"):
        tess_compile.simulate(model, 2, 1, spec=spec, example_inputs=(ids,))


def test_the_old_keywords_warn():
    model, ids = tiny_gpt(), torch.randint(0, VOCAB, (8, SEQ))
    with pytest.warns(FutureWarning, match=r"shard\(zero=True\) is deprecated: .*ParallelSpec\(q, d, dp=N, zero=3\)"):
        with pytest.raises(ValueError, match="zero=True"):  # no process group here: refused after the warning
            tess_compile.shard(model, 2, 1, example_inputs=(ids,), zero=True)


def test_the_command_line_runs_a_spec(tmp_path, monkeypatch, capsys):
    (tmp_path / "model.py").write_text(MODEL_PY)
    ParallelSpec(2, 1, dp=2).save(tmp_path / "spec.json")
    argv = ["run", "model.py:make_mlp", "--spec", "spec.json", "--simulate", "--steps", "2"]
    code, out, err = run_in_process(argv, tmp_path, monkeypatch, capsys)
    check_run(subprocess.CompletedProcess([], code, out, err), steps=2)
    assert "simulating 8 ranks in this process (dp 2 x pp 1 x 2.5d [q=2, q=2, d=1])" in err
    code, _, err = run_in_process([*argv, "--q", "2"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "--spec spec.json holds the mesh and the compile options: leave out --q" in err


# --------------------------------------------------------------------------- slow: gloo processes


@pytest.mark.slow
def test_the_example_plans_launches_trains_checkpoints_and_resumes(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_planned.py"), "--modes", "1d,2.5d",
                           "--layers", "2", "--steps", "4", "--checkpoint-step", "2", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    spec = ParallelSpec.load(tmp_path / "spec.json")  # the planner's pick for 8 processes
    assert spec.world_size == 8 and f"spec: {spec.describe()} (8 processes)" in proc.stdout, report
    assert "steps 3..4 differ from the first run's by 0.000e+00" in proc.stdout, report
    assert (tmp_path / "step2").is_dir(), report


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The step's tokens and targets, the same on every rank."""
    return tuple(torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))


def _three_steps(spec: ParallelSpec):
    """Three AdamW steps of `spec`'s layout of the tiny GPT (float64) on this rank: its `RankRun` and the losses."""
    ids, targets = _batch()
    run = tess_compile.parallelize(tiny_gpt(), spec, example_inputs=(ids,), loss_fn=_loss, timeout=300)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        losses.append(run.step(ids, target=targets).item())
        opt.step()
        opt.zero_grad()
    return run, losses


def _train_spec(rank, world_size, spec_dict):
    """Three AdamW steps of `spec_dict`'s layout of the tiny GPT (float64), then an evaluation: the losses."""
    run, losses = _three_steps(ParallelSpec.from_dict(spec_dict))
    ids, targets = _batch()
    return [*losses, run.loss(ids, target=targets).item()]


@pytest.mark.slow
def test_replicas_stages_and_zero_train_as_the_unsharded_model():
    spec = ParallelSpec(1, 2, dp=2, zero=3, pp=2, microbatches=2, options=CompileOptions(mode="1d"))
    results = run_local(_train_spec, 8, args=(spec.to_dict(),), timeout_s=900, collective_timeout_s=300)
    model, (ids, targets) = tiny_gpt(), _batch()
    opt, expected = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for _ in range(3):
        loss = _loss(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    with torch.no_grad():
        expected.append(_loss(model(ids), targets).item())
    for rank, losses in enumerate(results):
        assert max(abs(a - b) / b for a, b in zip(losses, expected)) <= 1e-12, (rank, losses, expected)


def _generate_on_zero(rank, world_size):
    from test_generation import gpt2, prompts

    spec = ParallelSpec(2, 1, dp=2, zero=3, options=CompileOptions(dynamic=True))
    run = tess_compile.parallelize(gpt2(), spec, example_inputs={"input_ids": prompts(8)}, timeout=300)
    return run.generate(prompts(), max_new_tokens=4, do_sample=False)


@pytest.mark.slow
def test_generation_on_replicas_with_zero():
    from test_generation import gpt2, prompts

    expected = gpt2().generate(prompts(), max_new_tokens=4, do_sample=False)
    for tokens in run_local(_generate_on_zero, 8, timeout_s=900, collective_timeout_s=300):
        assert torch.equal(tokens, expected)


def _train_block_units_and_hsdp(rank, world_size):
    """Three AdamW steps of HSDP (dp 4 = 2 replicas x 2 shards, x 1-D 2), one FSDP2 unit per block: its
    losses, its weights after the steps, and a block's placements. (No clipping: DTensor's sharding
    propagation of clip_grad_norm_'s foreach ops over this 5-D mesh takes minutes on first call.)"""
    from tess_compile.scale_out.block_units import BlockUnits

    run, values = _three_steps(ParallelSpec(1, 2, dp=4, zero=3, zero_shard=2, options=CompileOptions(mode="1d")))
    assert isinstance(run.module, BlockUnits) and len(run.module.parts) == LAYERS
    placements = str(run.module.parts[1].get_parameter("blocks.1.qkv.weight").placements)
    return values, run.module.full_state_dict(), placements


@pytest.mark.slow
def test_zero_units_per_block_and_hsdp_train_as_the_unsharded_model():
    results = run_local(_train_block_units_and_hsdp, 8, timeout_s=900, collective_timeout_s=300)
    model, (ids, targets) = tiny_gpt(), _batch()
    opt, expected = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for _ in range(3):
        loss = _loss(model(ids), targets)
        loss.backward()
        expected.append(loss.item())
        opt.step()
        opt.zero_grad()
    for rank, (values, weights, placements) in enumerate(results):
        assert max(abs(a - b) / b for a, b in zip(values, expected)) <= 1e-12, (rank, values, expected)
        for key, value in model.state_dict().items():  # not the key bias: AdamW amplifies its zero gradient's noise
            keep = slice(None) if not key.endswith("qkv.bias") else torch.arange(3 * HIDDEN) // HIDDEN != 1
            assert_close_rel(weights[key][keep], value[keep], 1e-12, f"rank {rank} {key}")
        assert placements.startswith("(Replicate(), _StridedShard(dim=0"), placements  # replicated, sharded
