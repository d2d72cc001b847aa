"""Token ids and class targets outside their range raise IndexError, as in the unsharded model.

A vocab-parallel lookup finds each id in one rank's block of the table; an
id outside every block would give a zero embedding, and a target outside
the split classes a loss without its target logit. The per-rank graph
checks the global ids right after its placeholders, before any collective,
so every rank raises (none is left waiting for its peers). Checked in
simulation at [2, 2, 2] and in mode "1d" (p = 4), for a small GPT, a vocab-
parallel cross entropy and Hugging Face GPT-2, and once over 4 gloo processes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel
from models import TinyGPT
from torch import nn

import tess_compile
from tess_compile.ops.collectives import COLLECTIVE_OPS, COMMUNICATING
from tess_compile.ops.local import check_in_range
from tess_compile.runtime.launch import run_local

VOCAB, HIDDEN, HEADS, SEQ = 16, 8, 4, 4
MESHES = [pytest.param(2, 2, "2.5d", id="q2d2"), pytest.param(2, 1, "1d", id="1d-p4")]


def tiny_gpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(11)
    model = TinyGPT(VOCAB, HIDDEN, HEADS, 1, SEQ)
    return model, torch.randint(0, VOCAB, (4, SEQ))


def index_error(fn, *args, **kwargs) -> str:
    with pytest.raises(IndexError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def checks_before_collectives(sim) -> list[torch.fx.Node]:
    """The range checks of the per-rank graph; each comes before every communicating
    collective and depends on none."""
    nodes = list(sim.program.graph.graph.nodes)
    checks = [n for n in nodes if n.target is check_in_range]
    communicating = [n for n in nodes if COLLECTIVE_OPS.get(n.target) in COMMUNICATING]
    for check in checks:
        assert all(nodes.index(check) < nodes.index(n) for n in communicating), f"{check.name} after a collective"
        pending, seen = [check], set()
        while pending:
            node = pending.pop()
            assert node.target not in COLLECTIVE_OPS, f"{check.name} checks a value that went through {node.name}"
            seen.add(node)
            pending.extend(n for n in node.all_input_nodes if n not in seen)
    return checks


@pytest.mark.parametrize("q, d, mode", MESHES)
@pytest.mark.parametrize("bad", [VOCAB, -1, 1000], ids=["vocab", "negative", "far"])
def test_token_id_out_of_range(q, d, mode, bad):
    model, ids = tiny_gpt()
    sim = tess_compile.simulate(model, q, d, example_inputs=(ids,), mode=mode, verify=True)
    bad_ids = ids.clone()
    bad_ids[3, 2] = bad  # a row that ranks of the last batch block hold
    index_error(model, bad_ids)  # the unsharded model raises
    msg = index_error(sim, bad_ids)
    assert msg == (
        f"token id {bad} is out of range for the embedding of vocabulary size {VOCAB} (tokens.weight): "
        f"token ids must be in [0, {VOCAB})"
    ), msg
    assert_close_rel(sim(ids), model(ids), name="output after the error")


@pytest.mark.parametrize("q, d, mode", MESHES)
def test_checks_come_before_any_collective(q, d, mode):
    model, ids = tiny_gpt()
    sim = tess_compile.simulate(model, q, d, example_inputs=(ids,), mode=mode)
    checks = checks_before_collectives(sim)
    assert [n.args[1:] for n in checks] == [
        (VOCAB, "token id", f"the embedding of vocabulary size {VOCAB} (tokens.weight)"),
        (SEQ, "token id", f"the embedding of vocabulary size {SEQ} (positions.weight)"),
    ]
    # The token ids are checked whole: the input placeholder itself, not this rank's rows.
    assert checks[0].args[0].op == "placeholder"


class TinyLM(nn.Module):
    """Embedding, vocab head, cross entropy over the vocab-split logits."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, targets):
        logits = self.head(self.embed(ids))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@pytest.mark.parametrize("q, d, mode", MESHES)
def test_target_out_of_range(q, d, mode):
    torch.manual_seed(2)
    model = TinyLM(VOCAB, HIDDEN)
    ids, targets = torch.randint(0, VOCAB, (4, 3)), torch.randint(0, VOCAB, (4, 3))
    sim = tess_compile.simulate(model, q, d, example_inputs=(ids, targets), mode=mode, verify=True)
    for bad in (VOCAB, -3):
        bad_targets = targets.clone()
        bad_targets[2, 1] = bad
        index_error(model, ids, bad_targets)
        msg = index_error(sim, ids, bad_targets)
        assert f"target {bad} is out of range for the cross entropy over {VOCAB} classes" in msg, msg
        assert f"targets must be in [0, {VOCAB}) or equal ignore_index -100" in msg, msg
    ignored = targets.clone()
    ignored[2, 1] = -100
    assert_close_rel(sim(ids, ignored), model(ids, ignored), name="loss with an ignored target")
    checks_before_collectives(sim)


def test_hf_gpt2_ids_and_labels():
    from hf_models import build

    model, kwargs = build("gpt2", 2, 2)
    vocab = model.config.vocab_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops that run replicated
        sim = tess_compile.simulate(model, 2, 2, example_inputs=kwargs)
    checks = checks_before_collectives(sim)
    assert len(checks) == 3, [n.args[1:] for n in checks]  # token ids, positions, labels

    bad = dict(kwargs, input_ids=kwargs["input_ids"].clone())
    bad["input_ids"][5, 1] = vocab
    index_error(model, **bad)
    msg = index_error(sim, **bad)
    assert f"token id {vocab} is out of range for the embedding of vocabulary size {vocab} (transformer.wte.weight)" in msg

    bad = dict(kwargs, labels=kwargs["labels"].clone())
    bad["labels"][6, 3] = -5
    index_error(model, **bad)
    assert "target -5 is out of range" in index_error(sim, **bad)


def test_check_in_range_skips_fake_and_meta_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_in_range(torch.full((3,), 7, device="meta"), 5, "token id", "a table")
    with FakeTensorMode():
        check_in_range(torch.full((3,), 7), 5, "token id", "a table")
    check_in_range(torch.empty(0, dtype=torch.long), 5, "token id", "a table")
    with pytest.raises(IndexError, match=r"token id 7 is out of range for a table: token ids must be in \[0, 5\)"):
        check_in_range(torch.tensor([1, 7, 9]), 5, "token id", "a table")


def _gloo_rank(rank: int, world_size: int) -> tuple[str, float]:
    model, ids = tiny_gpt()
    sharded = tess_compile.shard(model, 2, 1, example_inputs=(ids,), timeout=30)
    bad = ids.clone()
    bad[3, 0] = VOCAB  # in the rows of the ranks at row 1 only
    try:
        sharded(bad)
        message = "no error"
    except IndexError as err:
        message = str(err)
    out = sharded(ids).full_tensor()  # the ranks are still in step
    return message, float((out - model(ids)).abs().max())


@pytest.mark.slow
def test_every_gloo_rank_raises():
    results = run_local(_gloo_rank, 4, timeout_s=240, collective_timeout_s=30)
    for rank, (message, error) in enumerate(results):
        assert message.startswith(f"token id {VOCAB} is out of range"), f"rank {rank}: {message}"
        assert error < 1e-5, f"rank {rank}: output differs by {error} after the error"
