"""`benchmarks/published_configs.py`: its table from priced configurations (fast, on a priced result
given), and one published configuration's path at a size the tests afford (slow: one Llama 3 8B
layer, 4 GPUs, a short sequence, compiled on the meta device)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import benchmarks.published_configs as published

TINY = published.Published("Llama 3 8B, 1 layer, 4 GPUs, FSDP 2 x TP 2", "8b", 4, 2, 2, 256, tokens=1000.0, mfu=0.3,
                           layers=1)
PRICED = {"step_s": 2.0, "compute_s": 1.5, "comm_s": 0.5, "attention_s": 0.5, "tokens": 800.0, "mfu": 0.25,
          "tokens_at_seq": 1000.0, "memory_gb": 10.0, "seconds": 1.0}


def test_the_table_has_a_row_per_published_figure_with_its_error(monkeypatch):
    monkeypatch.setattr(published, "price", lambda config, cluster: PRICED)
    rows = published.table([TINY])
    assert [row[1:5] for row in rows] == [("tokens/s/GPU", "1000", "800", "-20%"), ("MFU", "30.0%", "25.0%", "-17%")]
    assert [row[9] for row in rows] == ["1000 (+0%)", "31.2% (+4%)"]  # the figure with attention at the seq's rate
    assert all(len(row) == len(published.HEADER) for row in rows)
    assert published.format_rows(rows).splitlines()[0].split()[:3] == ["config", "figure", "published"]


@pytest.mark.slow
def test_a_published_configuration_is_priced_through_the_planner():
    priced = published.price(TINY)
    tokens_per_gpu = TINY.local_batch * TINY.dp * TINY.seq / TINY.gpus
    assert priced["tokens"] == pytest.approx(tokens_per_gpu / priced["step_s"])
    assert 0 < priced["attention_s"] < priced["compute_s"] <= priced["step_s"]
    assert priced["tokens_at_seq"] > priced["tokens"]  # a sequence of 256 runs faster than the head dim's 128
