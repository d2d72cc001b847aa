"""The decode step priced on every mesh (`tess_compile.analysis.decode_plan`), against Pope et al.'s
formulas for a feed-forward layer (docs/generation.md): per chip and token, 1-D moves 2E(p-1)/p
elements (an all-reduce of the output), the 2-D weight-stationary layout (E over one axis, F over
the other) 2(q-1)/q (E + F)/q, its partial sums reduced over each axis in turn, and the tokens of
a 2.5-D mesh split over depth divide it again. No test here depends on a wall-clock time."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from tess_compile.analysis.decode_plan import format_decode_table, plan_decode
from tess_compile.cli import main
from tess_compile.core.layout import local_block
from tess_compile.core.options import CompileOptions
from tess_compile.passes.driver import compile_model

E, F, BATCH = 64, 256, 8


def mlp():
    """A feed-forward layer and one new token for each of BATCH sequences."""
    return nn.Sequential(nn.Linear(E, F, bias=False), nn.GELU(), nn.Linear(F, E, bias=False)), torch.randn(BATCH, 1, E)


def pope_elements(mode: str, q: int, d: int, p: int) -> float:
    """Elements one chip sends per token (ring collectives), by Pope et al.'s layouts."""
    if mode == "1d":
        return 2 * (p - 1) / p * E
    return 2 * (q - 1) / q * (E + F) / q / d  # the batch over depth: each slab's tokens, d times fewer


def test_a_decode_step_moves_what_pope_et_al_say():
    rows = {row.mesh.mode: row for row in plan_decode(mlp, 64)}
    assert set(rows) == {"1d", "2d", "2.5d"}
    for mode, row in rows.items():
        q, d, p = row.mesh.q, row.mesh.d, row.mesh.num_ranks
        assert row.wire_bytes_per_token / 4 == pytest.approx(pope_elements(mode, q, d, p), rel=1e-12), (mode, row)
        assert row.tokens_per_s == BATCH / row.step_s
    assert rows["2d"].batch_split == "none" and rows["2.5d"].batch_split == "depth"  # weight-stationary
    # at 64 chips 2-D moves (E + F) / (q E) = 5/8 of 1-D's ring volume per token (F = 4E) ...
    assert rows["2d"].wire_bytes_per_token < 0.6 * rows["1d"].wire_bytes_per_token
    # ... and the 2.5-D mesh [4, 4, 4], its batch split over depth, a fifth of it
    assert rows["2.5d"].wire_bytes_per_token < rows["1d"].wire_bytes_per_token / 4


def test_plan_decode_on_the_command_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "ffn.py").write_text(
        "import torch\nfrom torch import nn\n\ndef make():\n"
        f"    return nn.Sequential(nn.Linear({E}, {F}, bias=False), nn.GELU(), nn.Linear({F}, {E}, bias=False)), "
        f"torch.randn({BATCH}, 1, {E})\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "ffn.py:make", "--gpus", "64", "--decode", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "bytes/token" in out and "[4, 4, 4]" in out
    assert main(["plan", "ffn.py:make", "--gpus", "64", "--decode", "--json", "-", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)["decode"]
    assert [row["mode"] for row in rows][0] == "2.5d" and rows[0]["batch_split"] == "depth"
    assert format_decode_table([]).startswith("mode")


def test_laying_the_trained_weights_out_for_serving_is_priced():
    """Where the fastest decode lays the weights out otherwise than training (SUMMA's layout), the row
    prices the trained layout's own decode and the conversion: each rank receives what its new block holds
    and its old one does not (counted here element by element), paid back after a number of tokens."""
    model, inputs = mlp()
    (row,) = [r for r in plan_decode(mlp, 8, modes=("2.5d",))]
    assert row.batch_split == "depth" and row.trained_step_s >= row.step_s
    mesh = row.mesh
    trained, serving = (compile_model(model.eval(), mesh, (inputs,), options=CompileOptions(batch_split=split))
                        for split in ("depth_row", "depth"))
    old = {slot.name: slot.layout for slot in trained.params}
    received = [0] * mesh.num_ranks
    for slot in serving.params:
        ids = torch.arange(math.prod(slot.shape)).reshape(slot.shape)
        for rank in range(mesh.num_ranks):
            had = set(local_block(ids, old[slot.name], mesh, rank).flatten().tolist())
            wanted = set(local_block(ids, slot.layout, mesh, rank).flatten().tolist())
            received[rank] += 4 * len(wanted - had)
    assert row.conversion.bytes == max(received) > 0
    changed = sum(slot.layout != old[slot.name] for slot in serving.params)
    assert row.conversion.parameters == changed > 0 and row.conversion.seconds > 0
    saved = row.trained_step_s - row.step_s
    assert row.pays_back_tokens() == (math.ceil(row.conversion.seconds / saved) * BATCH if saved > 0 else math.inf)
    assert "convert MiB" in format_decode_table([row])
