"""Causal masks built from sizes alone become SDPA's `is_causal` at capture (`passes/causal_masks.py`).

transformers materializes its causal mask when traced; the captured attention then takes `is_causal=True`
instead, so no rank holds (or saves for backward) an L x S mask. A mask that reads an input (padding), or
that is not causal (a sliding window), stays; one that reads an input and is the causal mask AND more is
marked bounded by it (`CAUSAL_BOUNDED`: context attention skips each query's future keys). Exactness of the models so captured is the zoo's and the
token-split tests' (float64, 1e-12)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from conftest import assert_matches_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import tess_compile
from tess_compile.core.meta_keys import CAUSAL_BOUNDED
from tess_compile.keep_float64 import keeping_float64
from tess_compile.passes.capture import capture

SEQ = 8


def _sdpa_calls(model, *args, **kwargs) -> list[tuple[bool, bool]]:
    """(takes a mask, is_causal) of each attention of `model`'s captured graph."""
    gm = capture(model, args, kwargs)
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default)
    return [(len(n.args) > 3 and n.args[3] is not None or n.kwargs.get("attn_mask") is not None,
             bool(n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False))) for n in calls]


def test_transformers_causal_mask_becomes_is_causal_and_a_padding_mask_stays():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32, (2, SEQ))
    assert _sdpa_calls(model, input_ids=ids) == [(False, True)] * 2
    padded = torch.ones(2, SEQ, dtype=torch.long)
    padded[0, :3] = 0
    assert _sdpa_calls(model, input_ids=ids, attention_mask=padded) == [(True, False)] * 2


class _Masked(nn.Module):
    """Attention under a mask made from `arange`s: causal (float, additive) or a causal sliding window."""

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window

    def forward(self, x):
        q = x.unflatten(-1, (2, -1)).transpose(1, 2)
        i = torch.arange(x.shape[1])
        keep = i[None, :] <= i[:, None]
        if self.window is not None:
            keep = keep & (i[:, None] - i[None, :] < self.window)
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_an_additive_causal_mask_becomes_is_causal_and_a_window_stays():
    x = torch.randn(1, SEQ, 8)
    assert _sdpa_calls(_Masked(None), x) == [(False, True)]
    assert _sdpa_calls(_Masked(3), x) == [(True, False)]


class _Padded(nn.Module):
    """Attention under a bool mask of the causal mask and a padding mask read from an input, joined by
    `join` ("and", "or"; "pad": the padding mask alone)."""

    def __init__(self, join: str):
        super().__init__()
        self.join = join

    def forward(self, x, pad):
        q = x.unflatten(-1, (2, -1)).transpose(1, 2)
        i = torch.arange(x.shape[1])
        causal, keep = (i[None, :] <= i[:, None])[None, None], pad.bool()[:, None, None, :]
        mask = {"and": causal & keep, "or": causal | keep, "pad": keep.expand(-1, -1, x.shape[1], -1)}[self.join]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _bounded(model, *args, **kwargs) -> list[bool]:
    gm = capture(model, args, kwargs)
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default)
    return [bool(CAUSAL_BOUNDED.get(n, False)) for n in calls]


def test_a_padding_mask_joined_to_the_causal_mask_is_bounded_by_it():
    """transformers' causal and padding masks joined, and any causal mask AND a mask read from an input,
    are bounded by the causal mask; OR, or the padding mask alone, are not."""
    padded = torch.ones(2, SEQ, dtype=torch.long)
    padded[0, :3] = 0
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32, attn_implementation="sdpa")
    ids = torch.randint(0, 32, (2, SEQ))
    assert _bounded(LlamaForCausalLM(config), input_ids=ids, attention_mask=padded) == [True] * 2
    x = torch.randn(2, SEQ, 8)
    assert [_bounded(_Padded(join), x, padded) for join in ("and", "or", "pad")] == [[True], [False], [False]]


class _PaddedLM(nn.Module):
    """transformers' Llama called with a padded attention_mask, reduced to its valid tokens' logits'
    projection (a training step that returns its loss alone)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=32, attn_implementation="sdpa")
        self.model = LlamaForCausalLM(config).double()

    def forward(self, ids, mask):
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return (logits * mask[..., None]).sum()


def test_a_padded_causal_lm_takes_stripes():
    """A causal LM called with a padding mask (transformers joins it to the causal mask) keeps its mask,
    bounded by the causal one, and takes a striped token order like an `is_causal` model: exact, forward
    and every gradient, in float64."""
    ids = torch.randint(0, 32, (1, 32), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 32, dtype=torch.long)
    mask[0, :5] = 0
    model = _PaddedLM()
    oracle = copy.deepcopy(model)
    with keeping_float64(model, oracle):
        sim = tess_compile.simulate(model, 2, 2, example_inputs=(ids, mask))
        assert sim.program.rows.stripes == 8
        assert_matches_model(sim, oracle, ids, mask, rtol=1e-12)
