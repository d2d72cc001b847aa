"""How sure a plan is: the cluster's measured error of predicted step times (`Cluster.time_error`)
on every plan row, the rows within it of the pick marked as ties (in the table, the JSON and the
plot), the profile's self-check that measures it, and `tess-compile profile --no-check`."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
from test_cli import PLAN_MODEL_PY, SVG, run_in_process
from test_planner import make_mlp

from tess_compile import cli
from tess_compile.analysis.plan_plot import plan_svg
from tess_compile.analysis.plan_table import format_table
from tess_compile.analysis.planner import pick, plan
from tess_compile.analysis.profile_check import check_meshes, self_check, with_time_error
from tess_compile.cli import profile
from tess_compile.core.cluster import CALIBRATED_CLUSTER, Cluster
from tess_compile.core.mesh import Mesh


def plan_mlp(time_error: float | None, **options):
    """make_mlp's two meshes of 8 ranks ([2, 2, 2] and [8]) on the calibrated cluster with `time_error`."""
    return plan(make_mlp, 8, dp=1, pp=1, cluster=replace(CALIBRATED_CLUSTER, time_error=time_error), **options)


@pytest.fixture(scope="module")
def gap() -> float:
    """How much slower the second row is predicted than the pick, relative to the pick."""
    first, second = plan_mlp(None)
    return second.time.step_s / first.time.step_s - 1


def test_a_row_within_the_error_of_the_pick_is_a_tie(gap):
    rows = plan_mlp(gap * 1.01)
    assert [row.tie for row in rows] == [False, True]  # the pick never ties with itself
    assert all(row.error == gap * 1.01 for row in rows)
    assert [(row.to_dict()["error"], row.to_dict()["tie"]) for row in rows] == [(gap * 1.01, False),
                                                                                 (gap * 1.01, True)]
    assert [row.tie for row in plan_mlp(gap * 0.99)] == [False, False]


def test_no_ties_without_a_measured_error_or_a_row_that_fits():
    rows = plan_mlp(None)
    assert [(row.error, row.tie) for row in rows] == [(None, False)] * 2
    over_budget = plan_mlp(10.0, memory_budget=1.0)
    assert pick(over_budget) is None and not any(row.tie for row in over_budget)


def test_the_table_gives_the_error_and_marks_ties(gap):
    rows = plan_mlp(gap * 1.01)
    lines = format_table(rows).splitlines()
    assert ["~" in line for line in lines[1:3]] == [False, True], lines
    assert f" ~{rows[1].time.step_s:.4g} " in lines[2], lines  # on the step time
    assert lines[-1].startswith(f"# predicted step times are {100 * gap * 1.01:.3g}% off on this machine"), lines
    assert lines[-1].endswith("rows marked ~ are within that of the pick: ties"), lines
    assert format_table(plan_mlp(gap * 0.99)).splitlines()[-1].endswith("no other row that fits is that close")
    plain = format_table(plan_mlp(None))
    assert "~" not in plain and "#" not in plain and len(plain.splitlines()) == 3


def test_plan_command_with_a_measured_cluster_marks_ties_in_table_json_and_plot(tmp_path, monkeypatch, capsys):
    (tmp_path / "plan_model.py").write_text(PLAN_MODEL_PY)
    replace(CALIBRATED_CLUSTER, time_error=5.0).save(tmp_path / "cluster.json")
    argv = ["plan", "plan_model.py:make_mlp", "--gpus", "8", "--dp", "1", "--pp", "1", "--cluster", "cluster.json",
            "--json", "plan.json", "--plot", "plan.svg"]
    code, out, err = run_in_process(argv, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "~" in out and "are 500% off on this machine" in out, out
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["cluster"]["time_error"] == 5.0
    assert [(row["error"], row["tie"], row["pick"]) for row in document["rows"]] == [(5.0, False, True),
                                                                                     (5.0, True, False)]
    tooltips = ["".join(title.itertext()) for title in ET.parse(tmp_path / "plan.svg").iter(f"{SVG}title")]
    assert [tip.endswith(", fits, tie with the pick (within the 500% error)") for tip in tooltips] == [False, True]


def test_plan_svg_names_no_tie_without_an_error():
    tooltips = ET.fromstring(plan_svg(plan_mlp(None), budget=4e9)).iter(f"{SVG}title")
    assert not any("tie" in "".join(title.itertext()) for title in tooltips)


@pytest.mark.parametrize("bad", [-0.1, "12%", math.nan])
def test_cluster_time_error_must_be_a_relative_error(bad):
    with pytest.raises(ValueError, match="time_error"):
        replace(CALIBRATED_CLUSTER, time_error=bad)


def test_cluster_time_error_round_trips_through_json(tmp_path):
    measured = replace(CALIBRATED_CLUSTER, time_error=0.083)
    measured.save(tmp_path / "measured.json")
    CALIBRATED_CLUSTER.save(tmp_path / "unmeasured.json")
    assert Cluster.load(tmp_path / "measured.json") == measured
    assert Cluster.load(tmp_path / "unmeasured.json").time_error is None


def test_check_meshes_are_1d_and_the_reference_mesh():
    assert check_meshes(8) == [Mesh(1, 8, "1d"), Mesh(2, 2, "2.5d")]
    assert check_meshes(2) == [Mesh(1, 2, "1d")]  # no square divides 2: the reference mesh is 1-D too


def test_self_check_needs_a_process_group():
    with pytest.raises(ValueError, match="initialised process group"):
        self_check(CALIBRATED_CLUSTER)


def test_self_check_on_one_process_gives_a_relative_error(world_of_one):
    calls = []
    checked = with_time_error(CALIBRATED_CLUSTER, steps=1, warmup=1, progress=lambda *call: calls.append(call))
    assert math.isfinite(checked.time_error) and checked.time_error >= 0
    assert replace(checked, time_error=None) == CALIBRATED_CLUSTER
    assert calls == [(0, 1, "self-check on 1d [1]"), (1, 1, "")]


def test_profile_runs_the_self_check_unless_no_check(tmp_path, monkeypatch, capsys):
    """The command passes `--no-check` to its ranks, writes the error and prints it (the ranks faked)."""
    launched = []

    def fake_run_local(fn, world, *, args, **options):
        launched.append(args[2])  # (gpus_per_node, repeats, check, progress)
        return [replace(CALIBRATED_CLUSTER, time_error=0.083 if args[2] else None)] * world

    monkeypatch.setattr(profile, "run_local", fake_run_local)
    path = tmp_path / "cluster.json"
    assert cli.main(["profile", "--no-progress", "-o", str(path)]) == 0
    assert "self-check: predicted step times 8.3% off on this machine (2 configurations)" in capsys.readouterr().out
    assert Cluster.load(path).time_error == 0.083
    assert cli.main(["profile", "--no-progress", "--no-check", "-o", str(path)]) == 0
    assert "self-check" not in capsys.readouterr().out
    assert Cluster.load(path).time_error is None and launched == [True, False]
