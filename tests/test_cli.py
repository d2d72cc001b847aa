"""The tess-compile command line end to end, in subprocesses: `dump`, `run` (simulated and
on real gloo processes), the installed script, and user errors (exit 2, no traceback)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tess_compile import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_PY = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_mlp():
    return MLP(), torch.randn(4, 3, 8)


def make_model_only():
    return MLP()
'''
MESH = ["--q", "2", "--d", "2"]
# step, sharded loss, unsharded loss, relative difference
ROW = re.compile(r"^\s*(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(\d\.\d+e[+-]\d+)\s*$")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with model.py (the factories), bad_import.py and notes.txt."""
    path = tmp_path_factory.mktemp("cli")
    (path / "model.py").write_text(MODEL_PY)
    (path / "bad_import.py").write_text("import torch\nimport no_such_module_here\n")
    (path / "notes.txt").write_text("not python\n")
    return path


def run_cli(*argv: str, cwd, timeout: float = 120, script: str | None = None) -> subprocess.CompletedProcess:
    """Run the command line (`python -m tess_compile.cli`, or `script`) with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [script] if script else [sys.executable, "-m", "tess_compile.cli"]
    return subprocess.run([*command, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def report(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def check_run(proc: subprocess.CompletedProcess, steps: int) -> None:
    """Exit 0, one row per step with a small relative difference, and a summary line."""
    assert proc.returncode == 0, report(proc)
    rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert [int(row[0]) for row in rows] == list(range(1, steps + 1)), report(proc)
    for _, sharded, unsharded, diff in rows:
        assert abs(float(sharded) - float(unsharded)) <= 1e-4 * abs(float(unsharded)), report(proc)
        assert float(diff) <= cli.TOLERANCE, report(proc)
    summary = proc.stdout.splitlines()[-1]
    assert summary.startswith("max rel diff") and "wall time" in summary, report(proc)
    assert f"step {steps}/{steps}" in proc.stderr, report(proc)  # the progress bar, one line a step off a TTY


@pytest.mark.parametrize("argv", [["--help"], ["dump", "--help"], ["run", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    assert "usage: tess-compile" in capsys.readouterr().out


def test_installed_script_dumps_the_rewritten_graph(workdir):
    scripts = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    script = shutil.which("tess-compile", path=scripts)
    if script is None:
        pytest.fail("the tess-compile script is not installed: run `python3 -m pip install -e .` in the repository")
    proc = run_cli("dump", "model.py:make_mlp", *MESH, cwd=workdir, script=script)
    assert proc.returncode == 0, report(proc)
    assert "[q=2, q=2, d=2]" in proc.stdout, report(proc)
    assert "broadcast" in proc.stdout, report(proc)


def test_dump_writes_the_output_file(workdir):
    out = workdir / "out.txt"
    proc = run_cli("dump", "model.py:make_mlp", "--q", "2", "--d", "2", "--rank", "3", "-o", str(out),
                        cwd=workdir)
    assert proc.returncode == 0, report(proc)
    assert proc.stdout == "", report(proc)
    assert "broadcast" in out.read_text(), out.read_text()


def test_run_simulated(workdir):
    proc = run_cli("run", "model.py:make_mlp", "--q", "2", "--d", "2", "--simulate", "--steps", "3",
                        cwd=workdir)
    check_run(proc, steps=3)


def test_run_on_gloo_processes(workdir):
    proc = run_cli("run", "model.py:make_mlp", "--q", "2", "--d", "1", "--steps", "2", "--timeout", "120",
                        cwd=workdir, timeout=240)
    check_run(proc, steps=2)
    assert "(4 processes)" in proc.stdout, report(proc)


@pytest.mark.parametrize("argv, expected", [
    (["run", "model.py", *MESH], "expected FILE.py:FACTORY"),
    (["run", "missing.py:make_mlp", *MESH], "'missing.py' not found"),
    (["run", "notes.txt:make_mlp", *MESH], "'notes.txt' is not a .py file"),
    (["run", "bad_import.py:make", *MESH], "ModuleNotFoundError: No module named 'no_such_module_here' (line 2)"),
    (["dump", "model.py:make", *MESH], "no function 'make'; its callables are: MLP, make_mlp, make_model_only"),
    (["run", "model.py:make_model_only", *MESH], "returned MLP, not a pair (model, example_inputs)"),
    (["run", "model.py:make_mlp", "--q", "2", "--d", "3"], "d=3 > q=2"),
    (["dump", "model.py:make_mlp", "--q", "2", "--d", "3"], "d=3 > q=2"),
    (["run", "model.py:make_mlp", "--q", "4", "--d", "2", "--simulate"], "not divisible by d*q = 8"),
], ids=["no-factory", "missing-file", "not-py", "import-error", "no-such-factory", "not-a-pair",
        "run-d-gt-q", "dump-d-gt-q", "batch"])
def test_user_errors(workdir, argv, expected):
    proc = run_cli(*argv, cwd=workdir, timeout=60)
    assert proc.returncode == 2, report(proc)
    assert expected in proc.stderr, report(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, report(proc)


def test_losses_that_differ_exit_1(capsys):
    rows = [(1, 1.0, 1.0, 0.0), (2, 1.1, 1.0, 0.1)]
    assert cli.summarize(rows, wall=1.0, mode="simulated") == 1
    assert "at step 2" in capsys.readouterr().err
    assert cli.summarize(rows[:1], wall=1.0, mode="simulated") == 0
