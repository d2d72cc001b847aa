"""The benchmarks run (their numbers are printed, never asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the whole file: benchmark smoke runs

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compile_time_benchmark_runs_on_meta(capsys):
    bench = _load("compile_time")
    assert bench.main(["--configs", "8b", "--layers", "5", "--meshes", "2.5d:2,2,1", "1d:4", "--batch", "4", "--seq",
                       "8"]) == 0
    out = capsys.readouterr().out
    assert "[q=2, q=2, d=1]" in out and "1-D [p=4]" in out and " yes " in out and " no " in out


def test_bytes_per_layer_benchmark_runs(capsys):
    bench = _load("bytes_per_layer")
    row = bench.TABLE_1[0]
    payload, wire = bench.predicted(row.mesh, 4, 16, 4, 8)
    assert sum(payload["forward"].values()) == 2 * 4 * 8 * 16 * 4  # Megatron: two all-reduces of [b, s, h]
    assert wire["forward"] == 2 * (row.mesh.num_ranks - 1) / row.mesh.num_ranks * sum(payload["forward"].values())
    assert bench.main(["--table", "1", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM" in out and "[4,4,4]" in out



def test_paper_times_benchmark_runs(capsys):
    bench = _load("paper_times")
    assert bench.main(["--table", "1", "--no-plan"]) == 0
    out = capsys.readouterr().out
    assert "Tesseract [4,4,4] over Tesseract [8,8,1]" in out and "fastest first" in out


def test_memory_benchmark_runs(capsys):
    bench = _load("memory")
    assert bench.main(["--layers", "2", "--hidden", "32", "--heads", "8", "--batch", "8", "--seq", "4"]) == 0
    out = capsys.readouterr().out
    assert "2.5d  [4,4,2]" in out and "none+keep" in out and "selective" in out


def test_vs_dtensor_benchmark_runs(capsys, tmp_path):
    pytest.importorskip("expecttest")  # PyTorch's test Transformer imports it; CI installs only .[test]
    bench = importlib.import_module("benchmarks.vs_dtensor")  # by package name: spawned ranks import it
    assert bench.main(["--quick", "--out", str(tmp_path / "vs_dtensor.json")]) == 0
    out = capsys.readouterr().out
    assert "DTensor eager" in out and "DTensor lp eager" in out and "tess 2.5d" in out and "saved B/rank" in out
    assert "DTensor at its best:" in out
    (run,) = json.loads((tmp_path / "vs_dtensor.json").read_text())["runs"]
    losses = [row["loss_first"] for row in run["rows"]]  # the same model, weights and batch in every row
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])
    assert "CPU-bound ms" in out and all(row["cpu_ms_per_rank"] > 0 for row in run["rows"])


def test_plan_accuracy_benchmark_runs(capsys, tmp_path):
    bench = importlib.import_module("benchmarks.plan_accuracy")  # by package name: spawned ranks import it
    path = tmp_path / "cluster.json"
    assert bench.main(["--quick", "--steps", "1", "--warmup", "1", "--profile-out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "predicted ms" in out and "Kendall tau-b" in out and "1-D p=8" in out and "dp 2 x [2,2,1]" in out
    assert bench.kendall_tau_b([1, 2, 3], [1, 2, 3]) == 1.0 and bench.kendall_tau_b([1, 2, 3], [3, 2, 1]) == -1.0
    assert path.exists()


def test_generate_benchmark_runs(capsys):
    bench = importlib.import_module("benchmarks.generate")  # by package name: spawned ranks import it
    assert bench.main(["--quick", "-q", "2", "-d", "1", "--batches", "8"]) == 0  # batch 1's rows: the generation tests
    table = capsys.readouterr().out
    assert "tess 2.5d [2,2,1]" in table and "DTensor TP p=4" in table
    assert table.count(" True") == 5  # every row's tokens are the unsharded model's


def test_overhead_benchmark_runs(capsys, tmp_path):
    bench = importlib.import_module("benchmarks.overhead")  # by package name: spawned ranks import it
    out = tmp_path / "overhead.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| tess eager |" in table and "0 collectives" in table and "| per-rank graph alone |" in table
    assert "The parameters' node alone" in table
    assert "| all_gather along col |" in table and "not measured: --quick or --no-compile" in table
    record = json.loads(out.read_text())
    assert [row["configuration"] for row in record["world_of_one"]] == ["unsharded eager", "tess eager",
                                                                        "per-rank graph alone"]
    assert len(record["collectives"]) == len(bench.COLLECTIVE_CASES) and record["compiled_222"] == []
    assert isinstance(record["parameters_node_us_per_param"], float)
    # a world of one, then rank 0 of each mesh of overhead_fake_pg.CASES on the fake process group
    one, *ranks = record["host_time_fake_pg"]
    assert len(ranks) == len(importlib.import_module("benchmarks.overhead_fake_pg").CASES) - 1
    assert one["collectives_per_step"] == 0 and one["us_per_collective"] is None
    for rank0 in ranks:
        assert rank0["collectives_per_step"] > 0 and rank0["us_per_collective"] > rank0["c10d_us_per_collective"] > 0
    assert "runtime us/parameter" in table and "train_step us/parameter" in table
    assert [row["configuration"] for row in record["world_of_one_whole_steps"]] == ["unsharded eager",
                                                                                    "tess train_step"]


def test_gpu_check_skips_without_cuda_and_dry_runs_on_cpu(capsys, tmp_path):
    bench = _load("gpu_check")
    if not torch.cuda.is_available():
        assert bench.main([]) == 0
        assert "no CUDA device; skipped" in capsys.readouterr().out
    out = tmp_path / "gpu.json"
    assert bench.main(["--quick", "--device", "cpu", "--sections", "exact,kernels", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["errors"] == {}
    assert max(row["worst"] for row in record["sections"]["exact"]) < 1e-12
    assert {"collectives", "num_kernels"} <= set(record["sections"]["kernels"][0]["terms"]["forward"])


def test_gpu_check_memory_rows_count_what_the_prediction_counts(tmp_path):
    """A rank's step with the collectives replaced by buffers holds, by MemTracker's count, the
    predicted peak to the byte (before, the comm probed each output's shape by allocating it)."""
    bench = _load("gpu_check")
    out = tmp_path / "gpu.json"
    assert bench.main(["--quick", "--device", "cpu", "--sections", "memory", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["errors"] == {}
    for row in record["sections"]["memory"]:
        if row["mode"] != "1d":  # 1-D: a few hundred bytes over, in its norms' statistics
            assert row["tracked_bytes"] == row["predicted_bytes"], row


def test_gpu_check_reports_the_committed_runs(capsys):
    bench = _load("gpu_check")
    assert bench.main(["--report", str(BENCHMARKS / "results" / "gpu_check.json")]) == 0
    assert "local step = max(device, host)" in capsys.readouterr().out
    assert bench.main(["--report", str(BENCHMARKS / "results" / "gpu_check_h200.json")]) == 0
    assert "cudagraphs" in capsys.readouterr().out
    assert bench.main(["--report", str(BENCHMARKS / "results" / "gpu_check_h200_rerun.json")]) == 0
    out = capsys.readouterr().out
    assert "allocator MiB" in out and "split fit" in out and "fitted to Table 1 (" in out
    assert bench.main(["--report", str(BENCHMARKS / "results" / "gpu_check_h200_probe.json")]) == 0
    assert "AdamW step ms" in capsys.readouterr().out


def test_long_context_benchmark_runs(capsys, tmp_path):
    bench = importlib.import_module("benchmarks.long_context")  # by package name: spawned ranks import it
    rows = "tess 2.5d [2,2,2],tess 1d p=8,DTensor TP+SP"  # the other 2.5-D rows are these with an option changed
    assert bench.main(["--quick", "--configs", rows, "--out", str(tmp_path / "long_context.json")]) == 0
    out = capsys.readouterr().out
    assert "tess 2.5d [2,2,2]" in out and "DTensor TP+SP" in out and "torchtitan CP=8 (priced)" in out
    (run,) = json.loads((tmp_path / "long_context.json").read_text())["runs"]
    losses = [row["loss_first"] for row in run["rows"]]  # the same model, weights and sequence in every row
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])
