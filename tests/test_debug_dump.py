"""The debug switch: TESS_COMPILE_DUMP=folder writes every stage, pass by pass."""

from __future__ import annotations

import torch
from torch import nn

import tess_compile


def test_debug_switch_dumps_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("TESS_COMPILE_DUMP", str(tmp_path))
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    tess_compile.simulate(model, 2, 2, example_inputs=(torch.randn(4, 2, 4),), verify=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-capture.txt", "01-place.txt", "03-rewrite.txt", "passes.txt"]
    summary = (tmp_path / "passes.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == [
        "00 capture",
        "01 place",
        "02 verify placed",
        "03 rewrite",
        "04 merge products",
        "05 alike regions",
        "06 bucket gradients",
        "07 verify rewritten",
        "08 report repeated work",
    ]
    assert summary[0] == "00 capture: 8 nodes"
    assert summary[1] == "01 place: 8 nodes (8 -> 8, +0)", "placement is an analysis: no node added"
    assert "(8 -> " in summary[3] and ", +" in summary[3], "the rewrite adds collectives"
    assert "S(0)S(0)S(2)" in (tmp_path / "01-place.txt").read_text()
    assert "tess.all_gather" in (tmp_path / "03-rewrite.txt").read_text()
