"""Grouped-query attention whose key/value heads do not divide q: those heads run
replicated over col with a warning, and the model still matches."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import transformers
from conftest import assert_close_rel
from transformers import LlamaConfig, LlamaForCausalLM

import tess_compile

transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("q, kv_heads", [(2, 1), (3, 1), (3, 2)], ids=["q2-kv1", "q3-kv1", "q3-kv2"])
def test_indivisible_kv_heads_run_replicated(q, kv_heads):
    """Key/value heads that q does not divide. A head dim that q divides (q2-kv1) keeps the
    projection split on it and gathers the heads for attention; otherwise the projection runs
    whole over col, with a warning."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=16,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 96, (2 * q, 8))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = tess_compile.simulate(copy.deepcopy(model), q, 1, example_inputs=kwargs, verify=True)
    replicated = [w for w in caught if re.search("key/value heads run replicated|runs replicated over col", str(w.message))]
    assert bool(replicated) == (config.head_dim % q != 0)
    out, expected = sim(**kwargs), model(**kwargs)
    assert_close_rel(out.logits, expected.logits, rtol=1e-4, name="logits")
    out.loss.backward()
    expected.loss.backward()
    grads = sim.full_grads()
    scale = max(p.grad.abs().max() for p in model.parameters())
    for name, param in model.named_parameters():
        assert (grads[name] - param.grad).abs().max() <= 1e-4 * scale, f"grad {name}"


def test_indivisible_query_heads_are_still_an_error():
    """Only narrow (key/value) projections may replicate; query heads must divide q."""
    from models import LlamaBlock

    with pytest.raises(ValueError, match="head count"):
        tess_compile.simulate(LlamaBlock(12, 3), 2, 1, example_inputs=(torch.randn(2, 4, 12),))
