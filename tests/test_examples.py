"""The examples run end to end: examples/train_gpt.py, simulated and on real gloo processes,
trains with the sharded loss matching the unsharded loss at every step; its flags are checked
before anything runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_GPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--vocab", "32", "--seq", "8", "--batch", "4"]
# step, sharded loss, unsharded loss, abs diff
ROW = re.compile(r"^\s*(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(\d\.\d+e[+-]\d+)\s*$")
TOLERANCE = 1e-4


def run_example(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, TRAIN_GPT, *flags],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
    )


def check_table(proc: subprocess.CompletedProcess, steps: int) -> None:
    """Exit 0, one table row per step, every |sharded - unsharded| below TOLERANCE."""
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"train_gpt.py exited with {proc.returncode}\n{report}"
    rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert [int(r[0]) for r in rows] == list(range(1, steps + 1)), f"expected {steps} table rows\n{report}"
    for step, sharded, unsharded, diff in rows:
        sharded, unsharded, diff = float(sharded), float(unsharded), float(diff)
        assert abs(diff - abs(sharded - unsharded)) < 1e-5, f"step {step}: diff column is inconsistent\n{report}"
        assert diff < TOLERANCE, f"step {step}: sharded loss {sharded} vs unsharded {unsharded}\n{report}"
    assert "max abs diff" in proc.stdout.splitlines()[-1], f"no final summary line\n{report}"


def test_train_gpt_simulated():
    proc = run_example("--simulate", "--steps", "3", *TINY, "--q", "2", "--d", "2")
    check_table(proc, steps=3)


@pytest.mark.slow
def test_train_gpt_gloo_processes():
    proc = run_example("--steps", "2", *TINY, "--q", "2", "--d", "1")
    check_table(proc, steps=2)


@pytest.mark.parametrize("flags, fix", [
    (["--batch", "6"], "multiple of d*q"),
    (["--heads", "3", "--hidden", "48"], "multiple of 2"),
])
def test_train_gpt_rejects_bad_flags(flags, fix, capsys):
    spec = importlib.util.spec_from_file_location("train_gpt", TRAIN_GPT)
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse_args(["--simulate", *flags])
    assert exit_info.value.code == 2
    assert fix in capsys.readouterr().err
