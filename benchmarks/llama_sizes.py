"""Llama 3 at its real sizes, built on the meta device: the planner's and the compile-time benchmark's models.

Factories for `tess-compile plan benchmarks/llama_sizes.py:make_8b ...`: each
returns `(model, inputs)`, a transformers `LlamaForCausalLM` of Llama 3's
config (grouped-query attention, SwiGLU MLP, RoPE with theta 500,000,
untied embeddings) on the meta device, and a batch of 16 sequences of 4,096
tokens with labels (`input_ids` and `labels` on the CPU; only their shapes
matter). `make(layers=...)` gives the same model with fewer layers.

| config | layers | hidden | MLP | heads | KV heads | vocab |
|---|---|---|---|---|---|---|
| 8B | 32 | 4,096 | 14,336 | 32 | 8 | 128,256 |
| 70B | 80 | 8,192 | 28,672 | 64 | 8 | 128,256 |
| 405B | 126 | 16,384 | 53,248 | 128 | 8 | 128,256 |
"""

from __future__ import annotations

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["BATCH", "CONFIGS", "SEQ", "make", "make_70b", "make_8b"]

BATCH, SEQ = 16, 4096

CONFIGS = {
    "8b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32},
    "70b": {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64},
    "405b": {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128},
}


def make(size: str = "8b", layers: int | None = None, batch: int = BATCH, seq: int = SEQ):
    """`(model, inputs)` of the Llama 3 config `size` ("8b", "70b", "405b"), with `layers` layers if given."""
    transformers.logging.set_verbosity_error()
    fields = dict(CONFIGS[size])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(**fields, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def make_8b():
    return make("8b")


def make_70b():
    return make("70b")
