"""Causal masks built from sizes alone become SDPA's `is_causal` at capture (`passes/causal_masks.py`).

transformers materializes its causal mask when traced; the captured attention then takes `is_causal=True`
instead, so no rank holds (or saves for backward) an L x S mask. A mask that reads an input (padding), or
that is not causal (a sliding window), stays. Exactness of the models so captured is the zoo's and the
token-split tests' (float64, 1e-12)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

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
