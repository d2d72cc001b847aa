"""The tess-compile command line end to end, in subprocesses: `dump`, `run` (simulated and
on real gloo processes), `plan`, `--mode`, the installed script, and user errors (exit 2,
no traceback); `plan`'s options and errors also in this process, through `cli.main`;
`--version`, `plan --json` and `--plot`, and the progress bars (on a terminal only)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.distributed as dist

from tess_compile import cli
from tess_compile.analysis import profiling, rank_timing
from tess_compile.analysis.cost_model import StepTime
from tess_compile.analysis.memory import MemoryEstimate
from tess_compile.analysis.plan_plot import plan_svg
from tess_compile.analysis.planner import PlanRow
from tess_compile.cli.common import MODULE_NAME, package_version
from tess_compile.cli.plan import cluster_of
from tess_compile.cli.run import TOLERANCE, summarize
from tess_compile.core.cluster import CALIBRATED_CLUSTER
from tess_compile.core.mesh import Mesh
from tess_compile.core.parallel_spec import ParallelSpec

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


def test_dump_writes_the_output_file(workdir, monkeypatch, capsys):
    out = workdir / "out.txt"
    code, stdout, err = run_in_process(["dump", "model.py:make_mlp", "--q", "2", "--d", "2", "--rank", "3", "-o",
                                        str(out)], workdir, monkeypatch, capsys)
    assert code == 0 and stdout == "", err
    assert "all_gather" in out.read_text(), out.read_text()


def test_run_simulated(workdir, monkeypatch, capsys):
    code, out, err = run_in_process(["run", "model.py:make_mlp", "--q", "2", "--d", "2", "--simulate", "--steps", "3"],
                                    workdir, monkeypatch, capsys)
    check_run(subprocess.CompletedProcess([], code, out, err), steps=3)


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
    (["run", "model.py:make_mlp", "--q", "4", "--d", "2", "--simulate", "--batch-split", "depth_row"],
     "not divisible by the 8 ranks that split it"),
], ids=["no-factory", "missing-file", "not-py", "import-error", "no-such-factory", "not-a-pair",
        "run-d-gt-q", "dump-d-gt-q", "batch"])
def test_user_errors(workdir, argv, expected, monkeypatch, capsys):
    code, _, err = run_in_process(argv, workdir, monkeypatch, capsys)
    assert code == 2, err
    assert expected in err, err


@pytest.mark.slow  # the same error in this process: test_user_errors[import-error]
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


@pytest.mark.slow  # the planner's ranking is the fast tier's in test_planner.py
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
    """--dp/--pp auto: rows of (dp, pp, mode, mesh) whose ranks make the 8 GPUs; pp divides the 4 blocks
    (mode 1d, whose meshes take any count of ranks; the other modes' meshes: tests/test_planner.py)."""
    code, out, err = run_in_process(["plan", "plan_model.py:make_stack", "--gpus", "8", "--modes", "1d",
                                     "--summa", "broadcast", "--keep-blocks", "off"], plan_dir, monkeypatch, capsys)
    assert code == 0, err
    rows = re.findall(r"^(1d)\s+(\d+)\s+(\d+)\s+\[([\d, ]+)\]", out, re.MULTILINE)
    configs = set()
    for mode, dp, pp, mesh in rows:
        sides = [int(n) for n in mesh.split(",")]
        tp = sides[0] if mode == "1d" else sides[0] * sides[1] * sides[2]
        assert int(dp) * int(pp) * tp == 8 and 4 % int(pp) == 0, out
        configs.add((int(dp), int(pp)))
    assert {(1, 1), (2, 2), (2, 4), (2, 1), (1, 4), (8, 1)} <= configs, out


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
    (["plan", "plan_model.py:make_mlp", "--gpus", "8", "--json", "no_such_folder/plan.json"],
     "no_such_folder' of 'no_such_folder/plan.json' not found (--json): create it"),
], ids=["plan-no-mesh", "plan-bad-dp", "plan-bad-mode", "plan-no-gpus", "plan-algorithm", "plan-latency", "plan-no-factory",
        "dump-2d-depth", "run-bad-mode", "plan-json-folder"])
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



# --------------------------------------------------------------------------- --version, --json, --plot, progress

JSON_KEYS = {"schema", "tess_compile", "target", "gpus", "options", "model", "cluster", "memory_budget_bytes", "pick",
             "rows"}
ROW_KEYS = {"mode", "mesh", "tp_ranks", "dp", "pp", "microbatches", "zero", "zero_shard", "compiled", "fits", "step_s", "time_s",
            "comm_bytes", "memory_bytes", "redundant_work", "summa", "keep_blocks", "schedules", "note", "error", "tie",
            "spec", "pick"}
TIME_KEYS = {"forward", "backward", "optimizer", "calls", "forward_compute", "forward_comm", "backward_compute", "backward_comm"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "transient", "at_backward", "total"}
SVG = "{http://www.w3.org/2000/svg}"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == (f"tess-compile {importlib.metadata.version('tess-compile')} "
                                       f"(torch {torch.__version__})\n")


def test_version_from_a_source_tree_that_is_not_installed(monkeypatch):
    installed = importlib.metadata.version("tess-compile")  # an editable install: the checkout's pyproject's

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert package_version() == f"{installed} (not installed: the source tree at {ROOT})"


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """`plan --json FILE --plot FILE --pick FILE` of make_mlp on 8 GPUs (dp, pp and zero auto: 12 configurations), run
    once in this process: (exit code, stdout, stderr, the JSON document, the SVG text, the picked spec)."""
    folder = tmp_path_factory.mktemp("plan_outputs")
    (folder / "plan_model.py").write_text(PLAN_MODEL_PY)
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(folder)
        patch.setattr(sys, "path", list(sys.path))
        patch.setitem(sys.modules, MODULE_NAME, None)
        code = cli.main(["plan", "plan_model.py:make_mlp", "--gpus", "8", "--json", "plan.json", "--plot", "plan.svg",
                         "--pick", "spec.json"])
    document = json.loads((folder / "plan.json").read_text())
    spec = ParallelSpec.load(folder / "spec.json")
    return code, out.getvalue(), err.getvalue(), document, (folder / "plan.svg").read_text(), spec


def test_plan_json_has_the_documented_keys_and_a_row_per_configuration(planned):
    code, out, err, document, _, spec = planned
    assert code == 0 and err == "", err
    table = plan_rows(out)  # the table still goes to stdout beside --json FILE
    assert set(document) == JSON_KEYS and document["schema"] == 1
    rows = document["rows"]
    assert len(rows) == len(table) == 12, out
    for row, line in zip(rows, table):
        assert set(row) == ROW_KEYS and set(row["time_s"]) == TIME_KEYS and set(row["memory_bytes"]) == MEMORY_KEYS
        assert (row["mode"], str(row["mesh"]), f"{row['step_s']:.4g}") == (line[0], line[1], line[4]), (row, line)
        parts = {"params", "grads", "optimizer", "activations", "transient"}
        memory = row["memory_bytes"]
        assert row["compiled"] and row["fits"] and memory["at_backward"] == sum(memory[key] for key in parts)
        assert memory["total"] > memory["at_backward"]  # the step's peak: gradients and backward's work on top
    assert {(row["dp"], row["pp"]) for row in rows} == {(1, 1), (2, 1), (4, 1), (8, 1)}
    assert document["pick"] == 0 and [row["pick"] for row in rows] == [True] + [False] * 11
    # each row's whole layout as a parallel spec of the 8 GPUs; --pick wrote the pick's
    specs = [ParallelSpec.from_dict(row["spec"]) for row in rows]
    assert [(s.dp, s.pp, s.mode, s.world_size) for s in specs] == [(r["dp"], r["pp"], r["mode"], 8) for r in rows]
    assert spec == specs[0] and spec.options.keep_blocks == rows[0]["keep_blocks"]
    assert document["cluster"] == CALIBRATED_CLUSTER.to_dict()
    assert document["model"] == {"class": "Sequential", "parameters": 33088, "parameter_bytes": 4 * 33088,
                                 "repeated_blocks": 1, "batch": 16,
                                 "inputs": [{"shape": [16, 4, 64], "dtype": "float32"}]}


def test_plan_json_to_stdout_goes_in_place_of_the_table(plan_dir, monkeypatch, capsys):
    code, out, err = run_in_process(["plan", "plan_model.py:make_mlp", "--gpus", "8", "--dp", "1", "--pp", "1",
                                     "--json", "-"], plan_dir, monkeypatch, capsys)
    assert code == 0 and err == "", err
    document = json.loads(out)  # all of stdout is the document
    # 1d first: its MLP runs one all-reduce a step (forward), its backward none (passes/alike_regions.py)
    assert [(row["mode"], row["mesh"]) for row in document["rows"]] == [("1d", [8]), ("2.5d", [2, 2, 2])]


def test_plan_plot_draws_a_point_per_configuration_and_marks_the_pick(planned):
    _, _, _, document, svg, _ = planned
    assert svg.isascii()
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    points = [g for g in root.iter(f"{SVG}g") if g.get("class") == "point"]
    assert sorted(g.get("data-mode") for g in points) == sorted(row["mode"] for row in document["rows"])
    picks = [g for g in root.iter(f"{SVG}g") if g.get("class") == "pick"]
    assert len(picks) == 1
    best = document["rows"][0]
    assert "".join(picks[0].itertext()) == (f"pick: {best['mode']} [{', '.join(map(str, best['mesh']))}], "
                                            f"dp {best['dp']}, pp {best['pp']}")
    assert [line.get("class") for line in root.iter(f"{SVG}line")].count("budget") == 1
    texts = [" ".join(text.itertext()) for text in root.iter(f"{SVG}text")]
    assert "memory per rank (GB, log scale)" in texts and "predicted step time (ms)" in texts, texts
    assert "memory budget 40 GB" in texts and {"1d", "2d", "2.5d"} <= set(texts), texts


def test_plan_svg_shows_hollow_rows_over_the_budget_and_counts_those_that_did_not_compile():
    def row(mode, q, d, step_s, total, fits):
        time = StepTime(step_s / 2, 0.0, step_s / 2, 0.0, 0, 0)
        return PlanRow(Mesh(q, d, mode), time, MemoryEstimate(total, 0, 0, 0), fits=fits)

    rows = [row("1d", 1, 4, 2.0, 3e9, True), row("2.5d", 2, 1, 1.5, 9e9, False), PlanRow(Mesh(2, 1, "2d"))]
    svg = plan_svg(rows, budget=4e9)
    assert svg == plan_svg(rows, budget=4e9)  # deterministic
    root = ET.fromstring(svg)
    points = {g.get("data-mode"): g for g in root.iter(f"{SVG}g") if g.get("class") == "point"}
    assert set(points) == {"1d", "2.5d"}
    fills = {mode: [shape.get("fill") for shape in g if shape.tag != f"{SVG}title"] for mode, g in points.items()}
    assert fills == {"1d": ["#0072B2"], "2.5d": ["white"]}  # hollow: over the budget
    texts = [" ".join(text.itertext()) for text in root.iter(f"{SVG}text")]
    assert "predicted step time (s)" in texts and "memory per rank (GB)" in texts, texts
    assert "1 configuration did not compile (not shown)" in texts
    assert "pick: 1d [4], dp 1, pp 1" in texts
    assert 'class="pick"' not in plan_svg(rows[1:], budget=4e9)  # none fits: no pick


def test_progress_goes_to_stderr_on_a_terminal_only(plan_dir, monkeypatch, capsys):
    argv = ["plan", "plan_model.py:make_mlp", "--gpus", "8", "--dp", "1", "--pp", "1"]
    code, plain, err = run_in_process(argv, plan_dir, monkeypatch, capsys)
    assert code == 0 and err == "", err  # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run_in_process(argv, plan_dir, monkeypatch, capsys)
    assert code == 0 and out == plain, out  # nothing extra on stdout
    assert "tess-compile plan [" in err and "0/2 configurations" in err and "2/2 configurations" in err, err
    assert "s left, 2.5d [2, 2, 2], dp 1, pp 1" in err, err  # the time left and the configuration under way
    code, out, err = run_in_process([*argv, "--no-progress"], plan_dir, monkeypatch, capsys)
    assert code == 0 and out == plain and err == "", err


def test_profile_reports_each_measurement_to_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_timing, "RUN_S", 1e-3)  # short timed runs: only the calls are checked
    calls = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        profiling.profile_cluster(repeats=1, memory=1e9, progress=lambda *call: calls.append(call))
    finally:
        dist.destroy_process_group()
    total = calls[0][1]
    assert [done for done, _, _ in calls] == list(range(total + 1)) and {t for _, t, _ in calls} == {total}
    assert calls[0][2] == "kernel overhead" and calls[-1][2] == "" and all(what for *_, what in calls[:-1])


@pytest.mark.slow
def test_profile_command_draws_its_bar_on_a_terminal(tmp_path, monkeypatch, capfd):
    """Rank 0, a process of its own, draws the bar on the stderr it shares with the command."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["profile", "--processes", "2", "--repeats", "1", "-o", str(tmp_path / "cluster.json")]) == 0
    out, err = capfd.readouterr()
    assert "wrote" in out and "measurements" not in out, out
    assert "tess-compile profile [" in err and "41/41 measurements" in err and "all_reduce over 2 ranks" in err, err
