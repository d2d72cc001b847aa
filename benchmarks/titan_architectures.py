"""torchtitan's decoders for the coverage zoo (`benchmarks/architectures.py`).

`TITAN_ARCHITECTURES` maps a name to `("torchtitan", builder)` with the zoo's
contract: `builder(gen) -> (model, inputs, loss)`, tiny configs (hidden 32,
4 heads, 2 layers, vocab 64, sequence 8, batch 4); `build` makes them float64.
The models are torchtitan's own configs with their own layer builders:
llama3 (complex RoPE: `view_as_complex` / `view_as_real`, computed in
float32 and complex64 as torchtitan does) and qwen3 (QK norm, cos/sin RoPE).
Not here: torchtitan's MoE, whose experts run `_grouped_mm` in bfloat16
whatever the model's dtype (see docs/coverage.md). Attention is `scaled_dot_product_attention`,
causal, without masks: torchtitan's language models default to flex
attention, which needs a block mask built outside the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TITAN_ARCHITECTURES", "llama3_config", "sdpa_layers"]

HIDDEN, HEADS, LAYERS, VOCAB, SEQ, BATCH, MLP = 32, 4, 2, 64, 8, 4, 64


def _tokens_loss(labels: torch.Tensor):
    """Cross-entropy of the output logits against `labels`, in the logits' dtype."""

    def loss(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return loss


def sdpa_layers(layers: list) -> list:
    """The layer configs with causal SDPA as their inner attention."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention = dataclasses.replace(layer.attention, inner_attention=ScaledDotProductAttention.Config())
    return layers


class _KeepComplexCaches(nn.Module):
    """A decoder whose complex RoPE caches survive a cast: `Module.to(torch.float64)`
    casts complex buffers to the real dtype too, dropping their imaginary parts,
    so each torchtitan module recomputes its own buffers after a conversion."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens):
        return self.decoder(tokens)

    def _apply(self, fn, recurse=True):
        owners = [m for m in self.modules() if any(b.is_complex() for b in m.buffers(recurse=False))]
        super()._apply(fn, recurse)
        for module in owners:
            module._init_self_buffers()
        return self


def _decoder_config(model_cls, layers: list):
    """A torchtitan decoder's config from tiny layer configs, attention causal SDPA."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm

    normal = {"weight": torch.nn.init.normal_}
    return model_cls.Config(
        dim=HIDDEN,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN, param_init=normal),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=normal),
        layers=sdpa_layers(layers),
    )


def _decoder(config, gen):
    """A torchtitan decoder of `config`, initialised, with random tokens and labels."""
    model = config.build()
    model.init_states()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return _KeepComplexCaches(model), (tokens,), _tokens_loss(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))


def llama3_config():
    """torchtitan's Llama 3 config at the zoo's tiny sizes, attention causal SDPA."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    rope = ComplexRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=2 * SEQ, theta=500000, scaling="llama")
    layers = _build_llama3_layers(n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, hidden_dim=MLP, rope=rope,
                                  attn_backend="flex")
    return _decoder_config(Llama3Model, layers)


def _llama3(gen):
    return _decoder(llama3_config(), gen)


def _qwen3_rope():
    from torchtitan.models.common import CosSinRoPE

    return CosSinRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=2 * SEQ, theta=1000000.0)


def _qwen3(gen):
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers

    layers = _build_qwen3_layers(n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, n_kv_heads=HEADS,
                                 head_dim=HIDDEN // HEADS, hidden_dim=MLP, attn_backend="flex", rope=_qwen3_rope())
    return _decoder(_decoder_config(Qwen3Model, layers), gen)



TITAN_ARCHITECTURES: dict[str, tuple[str, Callable]] = {
    "titan-llama3": ("torchtitan", _llama3),
    "titan-qwen3": ("torchtitan", _qwen3),
}
