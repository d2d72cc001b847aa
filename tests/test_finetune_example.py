"""examples/finetune_gpt2.py runs end to end, simulated and on real gloo processes: the sharded
Hugging Face GPT-2's loss matches the unsharded model's at every step, the gathered weights match
the unsharded model's, and the gathered model writes a sample."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINETUNE = os.path.join(ROOT, "examples", "finetune_gpt2.py")
TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8", "--batch", "4"]
# step, sharded loss, unsharded loss, abs diff
ROW = re.compile(r"^\s*(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(\d\.\d+e[+-]\d+)\s*$")
WEIGHTS = re.compile(r"gathered weights vs unsharded model: max abs diff (\S+)")
RTOL = 1e-4


def run_example(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, FINETUNE, *flags],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False,
    )


def check_run(proc: subprocess.CompletedProcess, steps: int) -> None:
    """Exit 0, one table row per step with sharded and unsharded losses within RTOL (relative),
    matching gathered weights, a sample, and the summary line last."""
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"finetune_gpt2.py exited with {proc.returncode}\n{report}"
    lines = proc.stdout.splitlines()
    rows = [m.groups() for m in map(ROW.match, lines) if m]
    assert [int(r[0]) for r in rows] == list(range(1, steps + 1)), f"expected {steps} table rows\n{report}"
    for step, sharded, unsharded, diff in rows:
        sharded, unsharded, diff = float(sharded), float(unsharded), float(diff)
        assert unsharded > 0, f"step {step}: a language-model loss should be positive\n{report}"
        assert abs(diff - abs(sharded - unsharded)) < 1e-5, f"step {step}: diff column is inconsistent\n{report}"
        assert abs(sharded - unsharded) <= RTOL * abs(unsharded), (
            f"step {step}: sharded loss {sharded} vs unsharded {unsharded}\n{report}"
        )
    weights = [float(m.group(1)) for m in map(WEIGHTS.search, lines) if m]
    assert len(weights) == 1 and weights[0] < 1e-3, f"gathered weights differ from the unsharded model's\n{report}"
    samples = [line for line in lines if line.startswith("after training (gathered weights), greedy: 'The weather")]
    assert len(samples) == 1, f"no greedy sample from the gathered weights\n{report}"
    assert "max abs diff" in lines[-1] and "wall time" in lines[-1], f"no final summary line\n{report}"


@pytest.mark.slow  # the fast tier runs examples/train_gpt.py (tests/test_examples.py)
def test_finetune_gpt2_simulated():
    proc = run_example("--simulate", "--steps", "3", *TINY, "--q", "2", "--d", "2")
    check_run(proc, steps=3)


@pytest.mark.slow
def test_finetune_gpt2_gloo_processes():
    proc = run_example("--steps", "2", *TINY, "--q", "2", "--d", "1")
    check_run(proc, steps=2)


@pytest.mark.slow
def test_finetune_gpt2_rejects_bad_batch():
    proc = run_example("--simulate", "--batch", "6", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "multiple of d*q" in proc.stderr, proc.stderr
    assert "step" not in proc.stdout
