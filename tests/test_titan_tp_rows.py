"""torchtitan's own tensor parallelism as rows of the step benchmark (`benchmarks/vs_torchtitan.py`):
its `parallelize_llama` (spmd_types backend, sequence parallelism) and tess-compile in 1-D and 2.5-D
train the zoo's tiny Llama 3 from the same weights on the same batch, and their losses agree, so
the rows keep running as torchtitan changes."""

from __future__ import annotations

import importlib
import json

import pytest

pytestmark = pytest.mark.slow  # gloo process runs


def test_torchtitan_rows_run_and_agree_with_tess(capsys, tmp_path):
    pytest.importorskip("torchtitan")
    bench = importlib.import_module("benchmarks.vs_torchtitan")  # by package name: spawned ranks import it
    assert bench.main(["--quick", "--out", str(tmp_path / "vs_torchtitan.json")]) == 0
    out = capsys.readouterr().out
    assert "torchtitan at its best:" in out
    (run,) = json.loads((tmp_path / "vs_torchtitan.json").read_text())["runs"]
    rows = {row["configuration"]: row for row in run["rows"]}
    assert set(rows) == {"torchtitan eager", "tess 1d", "tess 2.5d"}
    for key in ("loss_first", "loss_last"):  # the same model, weights, batch and steps in every row
        losses = [row[key] for row in rows.values()]
        assert max(losses) - min(losses) < 1e-5 * abs(losses[0]), (key, losses)
    assert rows["torchtitan eager"]["moved_bytes"] > 0
