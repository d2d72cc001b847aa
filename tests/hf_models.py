"""Small Hugging Face models with random weights for the HF test suite (no tests here).

`build(name, q, d, dtype)` returns `(model, kwargs)`: a model from a small
config (nothing is downloaded, every dropout probability 0) and the keyword
inputs of one batch of `2*d*q` examples (a loss is computed: `labels` are
given). The same `(name, q, d)` gives the same weights and inputs in every
process: everything is drawn from a seeded generator, so a gloo worker can
rebuild its oracle.

Sizes depend on q only: hidden 16, 4 heads, vocab 64 for q = 2; hidden 24,
6 heads, vocab 96 for q = 3 (every split dimension divisible by q; Llama
has `q` key/value heads for `2q` query heads, so column j holds the query
heads 2j, 2j+1 and the key/value head j they use).

HF initialises LayerNorm weights to ones and biases to zeros; those 1-D
parameters get a small random offset so that every tensor is distinct (a
shard of a bias swapped with another would otherwise go unnoticed).
"""

from __future__ import annotations

import torch
import transformers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

__all__ = ["MODEL_NAMES", "SEQ", "build", "sizes"]

transformers.logging.set_verbosity_error()

MODEL_NAMES = ["gpt2", "llama", "bert", "vit"]
SEQ = 8
LAYERS = 2
SEEDS = {"gpt2": 101, "llama": 102, "bert": 103, "vit": 104}


def sizes(q: int) -> dict:
    """hidden, heads, kv_heads, vocab, mlp for a mesh with this q."""
    if q == 3:
        return {"hidden": 24, "heads": 6, "kv_heads": 3, "vocab": 96, "mlp": 48}
    if q in (1, 2):
        return {"hidden": 16, "heads": 4, "kv_heads": 2, "vocab": 64, "mlp": 32}
    raise ValueError(f"no HF test sizes for q={q}")


def _perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))


def _gpt2(s, batch, gen):
    cfg = GPT2Config(
        vocab_size=s["vocab"], n_positions=SEQ, n_embd=s["hidden"], n_layer=LAYERS, n_head=s["heads"],
        n_inner=s["mlp"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        use_cache=False, tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, s["vocab"], (batch, SEQ), generator=gen)
    return model, {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _llama(s, batch, gen):
    cfg = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"], num_hidden_layers=LAYERS,
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=2 * SEQ,
        attention_dropout=0.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=False, use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, s["vocab"], (batch, SEQ), generator=gen)
    return model, {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _bert(s, batch, gen):
    cfg = BertConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=LAYERS, num_attention_heads=s["heads"],
        intermediate_size=s["mlp"], max_position_embeddings=SEQ, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(cfg)
    ids = torch.randint(0, s["vocab"], (batch, SEQ), generator=gen)
    # Two segments: the second starts at a position that varies along the batch.
    split = torch.arange(batch).remainder(SEQ - 3) + 2
    positions = torch.arange(SEQ)
    token_type_ids = (positions[None, :] >= split[:, None]).long()
    # Padding: row b has b % 3 padded positions at the end (the first row has none).
    pad = torch.arange(batch).remainder(3)
    attention_mask = (positions[None, :] < (SEQ - pad)[:, None]).long()
    # Masked-LM labels on about half of the unpadded positions, -100 elsewhere.
    chosen = (torch.rand(batch, SEQ, generator=gen) < 0.5) & attention_mask.bool()
    chosen[:, 0] = True
    labels = torch.where(chosen, torch.randint(0, s["vocab"], (batch, SEQ), generator=gen), torch.full_like(ids, -100))
    return model, {"input_ids": ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask, "labels": labels}


def _vit(s, batch, gen):
    cfg = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=s["hidden"], num_hidden_layers=LAYERS,
        num_attention_heads=s["heads"], intermediate_size=s["mlp"], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=6, qkv_bias=True,
    )
    model = ViTForImageClassification(cfg)
    pixels = torch.randn(batch, 3, 8, 8, generator=gen)
    labels = torch.randint(0, 6, (batch,), generator=gen)
    return model, {"pixel_values": pixels, "labels": labels}


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit}


def build(name: str, q: int, d: int, dtype: torch.dtype = torch.float32):
    """`(model, kwargs)` of model `name` for the mesh `[q, q, d]` (batch `2*d*q`), in `dtype`."""
    torch.manual_seed(SEEDS[name])  # HF initialises weights from the global generator
    gen = torch.Generator().manual_seed(SEEDS[name] + 1000)
    model, kwargs = BUILDERS[name](sizes(q), 2 * d * q, gen)
    _perturb(model, gen)
    model = model.to(dtype)
    kwargs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
    return model, kwargs
