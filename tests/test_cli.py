"""The tess-compile command line end to end, in subprocesses: `dump`, `run` (simulated and
on real gloo processes), `plan`, `--mode`, the installed script, and user errors (exit 2,
no traceback); `plan`'s options and errors also in this process, through `cli.main`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tess_compile import cli
from tess_compile.cli.common import MODULE_NAME
from tess_compile.cli.plan import cluster_of
from tess_compile.cli.run import TOLERANCE, summarize

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
        assert float(diff) <= TOLERANCE, report(proc)
    summary = proc.stdout.splitlines()[-1]
    assert summary.startswith("max rel diff") and "wall time" in summary, report(proc)
    assert f"step {steps}/{steps}" in proc.stderr, report(proc)  # the progress bar, one line a step off a TTY


@pytest.mark.parametrize("argv", [["--help"], ["dump", "--help"], ["check", "--help"], ["run", "--help"], ["plan", "--help"]])
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
    assert "# summa=auto on mesh [q=2, q=2, d=2]: gather for 2 products" in proc.stdout, report(proc)
    assert "tess.all_gather" in proc.stdout, report(proc)


def test_dump_writes_the_output_file(workdir):
    out = workdir / "out.txt"
    proc = run_cli("dump", "model.py:make_mlp", "--q", "2", "--d", "2", "--rank", "3", "-o", str(out),
                        cwd=workdir)
    assert proc.returncode == 0, report(proc)
    assert proc.stdout == "", report(proc)
    assert "all_gather" in out.read_text(), out.read_text()


def test_run_simulated(workdir):
    proc = run_cli("run", "model.py:make_mlp", "--q", "2", "--d", "2", "--simulate", "--steps", "3",
                        cwd=workdir)
    check_run(proc, steps=3)


@pytest.mark.slow
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
def test_user_errors(workdir, argv, expected, monkeypatch, capsys):
    code, _, err = run_in_process(argv, workdir, monkeypatch, capsys)
    assert code == 2, err
    assert expected in err, err


def test_a_user_error_exits_2_without_a_traceback(workdir):
    proc = run_cli("run", "bad_import.py:make", *MESH, cwd=workdir, timeout=60)
    assert proc.returncode == 2, report(proc)
    assert "ModuleNotFoundError: No module named 'no_such_module_here' (line 2)" in proc.stderr, report(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, report(proc)


def test_losses_that_differ_exit_1(capsys):
    rows = [(1, 1.0, 1.0, 0.0), (2, 1.1, 1.0, 0.1)]
    assert summarize(rows, wall=1.0, mode="simulated") == 1
    assert "at step 2" in capsys.readouterr().err
    assert summarize(rows[:1], wall=1.0, mode="simulated") == 0


# --------------------------------------------------------------------------- plan and --mode

PLAN_MODEL_PY = '''
import torch
from torch import nn


def make_mlp():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, torch.randn(16, 4, 64)


def make_stack():
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4)]
    return nn.Sequential(*blocks), torch.randn(32, 4, 64)
'''
# mode, (dp, pp: not captured), mesh, forward s, backward s, step s, comm, saved, memory, redundant work, note
PLAN_ROW = re.compile(r"^(1d|2d|2\.5d|3d)\s+\d+\s+\d+\s+(\[[\d, ]+\])\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(.*)$")


@pytest.fixture
def plan_dir(tmp_path):
    (tmp_path / "plan_model.py").write_text(PLAN_MODEL_PY)
    return tmp_path


def plan_rows(stdout: str) -> list[tuple]:
    return [m.groups() for m in map(PLAN_ROW.match, stdout.splitlines()) if m]


def run_in_process(argv: list[str], folder, monkeypatch, capsys) -> tuple[int, str, str]:
    """cli.main(argv) in `folder`: (exit code, stdout, stderr); argparse's own exits included."""
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_factory adds the file's folder
    monkeypatch.setitem(sys.modules, MODULE_NAME, None)  # and imports it under this name
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_the_meshes_fastest_first(plan_dir):
    proc = run_cli("plan", "plan_model.py:make_mlp", "--gpus", "64", "--gpus-per-node", "4", "--dp", "1", "--pp", "1",
                   "-v", cwd=plan_dir)
    assert proc.returncode == 0, report(proc)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# 64 GPUs, 4 per node; intra-node 98.083 GB/s"), report(proc)
    assert lines[1].split()[:4] == ["mode", "dp", "pp", "mesh"], report(proc)
    rows = plan_rows(proc.stdout)
    assert sorted((row[0], row[1]) for row in rows) == [("1d", "[64]"), ("2.5d", "[4, 4, 4]"),
                                                        ("2d", "[8, 8, 1]")], report(proc)
    steps = [float(row[4]) for row in rows]
    assert steps == sorted(steps), report(proc)
    assert [row[8] for row in rows] == ["1.00"] * 3, report(proc)  # redundant work: none
    assert "plan: compiling Sequential for 2.5d [4, 4, 4], dp 1, pp 1 (3 of 3)" in proc.stderr, report(proc)
    assert "Traceback" not in proc.stderr, report(proc)


def test_plan_enumerates_data_and_pipeline_parallelism(plan_dir, monkeypatch, capsys):
    """--dp/--pp auto: rows of (dp, pp, mode, mesh) whose ranks make the 64 GPUs; pp divides the 4 blocks."""
    code, out, err = run_in_process(["plan", "plan_model.py:make_stack", "--gpus", "64", "--modes", "1d,2d,2.5d",
                                     "--summa", "broadcast", "--keep-blocks", "off"], plan_dir, monkeypatch, capsys)
    assert code == 0, err
    rows = re.findall(r"^(1d|2d|2\.5d)\s+(\d+)\s+(\d+)\s+\[([\d, ]+)\]", out, re.MULTILINE)
    configs = set()
    for mode, dp, pp, mesh in rows:
        sides = [int(n) for n in mesh.split(",")]
        tp = sides[0] if mode == "1d" else sides[0] * sides[1] * sides[2]
        assert int(dp) * int(pp) * tp == 64 and 4 % int(pp) == 0, out
        configs.add((int(dp), int(pp)))
    assert {(1, 1), (2, 2), (16, 4), (2, 1), (1, 4)} <= configs, out


def test_plan_with_cluster_options(plan_dir, monkeypatch, capsys):
    code, out, err = run_in_process(
        ["plan", "plan_model.py:make_mlp", "--gpus", "8", "--gpus-per-node", "8", "--modes", "1d", "--dp", "1", "--pp", "1",
         "--intra-bandwidth", "200", "--intra-latency", "2", "--inter-bandwidth", "12.5", "--inter-latency", "5",
         "--tflops", "100", "--algorithm", "tree", "--memory-gb", "80", "--matmul-half-size", "0",
         "--memory-bandwidth", "1500", "--kernel-overhead", "3", "--overlap"], plan_dir, monkeypatch, capsys)
    assert code == 0, err
    assert out.startswith("# 8 GPUs, 8 per node; intra-node 200 GB/s, 2 us; inter-node 12.5 GB/s, 5 us; "
                          "100 TFLOP/s and 80 GB per GPU; matmul half size 0, memory 1500 GB/s, 3 us a kernel; "
                          "tree collectives; compute and communication overlapped\n"), out
    assert [(row[0], row[1], row[9]) for row in plan_rows(out)] == [("1d", "[8]", "within one node")], out


def test_plan_over_the_memory_budget_exits_1(plan_dir, monkeypatch, capsys):
    code, out, err = run_in_process(["plan", "plan_model.py:make_mlp", "--gpus", "8", "--memory-gb", "1e-6",
                                     "--dp", "1", "--pp", "1"], plan_dir, monkeypatch, capsys)
    assert code == 1, err
    assert len(plan_rows(out)) == 2, out
    assert "over the budget of 1e-06 GB" in out, out
    assert "no mesh of 8 GPUs fits" in err, err


@pytest.mark.parametrize("argv, expected", [
    (["plan", "plan_model.py:make_mlp", "--gpus", "8", "--modes", "2d", "--dp", "1", "--pp", "1"],
     "use 4 or 9 GPUs, or add mode '1d'"),
    (["plan", "plan_model.py:make_mlp", "--gpus", "8", "--dp", "3"], "dp=3 does not divide 8 GPUs"),
    (["plan", "plan_model.py:make_mlp", "--gpus", "8", "--modes", "1d,4d"], "mode '4d' is not one of"),
    (["plan", "plan_model.py:make_mlp", "--gpus", "0"], "expected a number > 0 (int), got '0'"),
    (["plan", "plan_model.py:make_mlp", "--gpus", "8", "--algorithm", "fast"], "invalid choice: 'fast'"),
    (["plan", "plan_model.py:make_mlp", "--gpus", "8", "--inter-latency", "-1"], "expected a number >= 0"),
    (["plan", "plan_model.py:nothing", "--gpus", "8"], "no function 'nothing'"),
    (["dump", "plan_model.py:make_mlp", "--q", "2", "--d", "2", "--mode", "2d"], "mode '2d' (Optimus) is the d=1 case"),
    (["run", "plan_model.py:make_mlp", "--q", "2", "--d", "1", "--mode", "4d"], "invalid choice: '4d'"),
], ids=["plan-no-mesh", "plan-bad-dp", "plan-bad-mode", "plan-no-gpus", "plan-algorithm", "plan-latency", "plan-no-factory",
        "dump-2d-depth", "run-bad-mode"])
def test_plan_and_mode_user_errors(plan_dir, monkeypatch, capsys, argv, expected):
    code, _, err = run_in_process(argv, plan_dir, monkeypatch, capsys)
    assert code == 2, err
    assert expected in err, err


def test_dump_in_mode_1d(workdir, monkeypatch, capsys):
    code, out, err = run_in_process(["dump", "model.py:make_mlp", "--q", "1", "--d", "4", "--mode", "1d"], workdir,
                                    monkeypatch, capsys)
    assert code == 0, err
    assert "1-D [p=4]" in out, out
    assert "broadcast" not in out, out  # Megatron: all-reduces only


def test_run_simulated_in_mode_1d(workdir, monkeypatch, capsys):
    code, out, err = run_in_process(["run", "model.py:make_mlp", "--q", "1", "--d", "4", "--mode", "1d", "--simulate",
                                     "--steps", "2"], workdir, monkeypatch, capsys)
    check_run(subprocess.CompletedProcess([], code, out, err), steps=2)


def test_plan_defaults_are_the_calibrated_cluster():
    """Without cluster flags, `plan` prices with the same constants as `tess_compile.plan`."""
    from tess_compile.core.cluster import CALIBRATED_CLUSTER

    args = cli.make_parser().parse_args(["plan", "model.py:make", "--gpus", "8"])
    assert cluster_of(args) == CALIBRATED_CLUSTER
