"""A zoo of small architectures from third-party model code, for coverage checks.

`ARCHITECTURES` maps a name to `(library, builder)`; `build(name)` returns
`Case(model, inputs, loss)`: a model from a tiny config with random weights
(nothing is downloaded, dropout 0), float64, keyword or positional inputs of
batch 4 (a multiple of d*q at [2,2,2]), and `loss(output) -> scalar`.
Every model has 4 attention heads (hidden 32), so heads divide both q=2 and
p=4. Weights and inputs come from seeded generators: the same name builds the
same case in every process.

Libraries: Hugging Face transformers, torch itself (`torch.nn` layers and
the Transformer of PyTorch's tensor-parallel tests) and torchtitan
(`benchmarks/titan_architectures.py`). Mixtral's experts use transformers'
`batched_mm` implementation: the eager one loops over the experts a batch
routes to (data-dependent, not capturable), `grouped_mm` has no float64. Each is
imported when one of its models is built; a missing library raises
ImportError, so callers can skip its models.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.titan_architectures import TITAN_ARCHITECTURES

__all__ = ["ARCHITECTURES", "Case", "build", "libraries"]

HIDDEN, HEADS, LAYERS, VOCAB, SEQ, BATCH, MLP = 32, 4, 2, 64, 8, 4, 64


@dataclass
class Case:
    model: nn.Module
    inputs: object  # a tuple of positional inputs or a dict of keyword inputs
    loss: Callable


def _ids(gen, vocab=VOCAB, shape=(BATCH, SEQ)):
    return torch.randint(0, vocab, shape, generator=gen)


def _config(name: str, **fields):
    """A transformers config with every dropout probability 0 and no cache."""
    import transformers

    cfg = getattr(transformers, name)(**fields)
    for key, value in vars(cfg).items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(cfg, key, 0.0)
    cfg.use_cache = False
    return cfg


def _logits_loss(labels: torch.Tensor):
    """Cross-entropy of the output's logits against `labels`, in the logits' dtype
    (Hugging Face's own losses upcast to float32, which would hide float64 errors)."""

    def loss(out):
        logits = out.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    return loss


def _lm(model_cls, cfg, gen, **extra):
    """A causal or masked LM from `cfg`: ids in, cross-entropy against random labels."""
    ids = _ids(gen, cfg.vocab_size)
    return model_cls(cfg), {"input_ids": ids, **extra}, _logits_loss(_ids(gen, cfg.vocab_size))


def _hf_causal(config_name: str, model_name: str, **fields):
    def builder(gen):
        import transformers

        cfg = _config(config_name, **fields)
        return _lm(getattr(transformers, model_name), cfg, gen)

    return builder


_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=2 * SEQ, tie_word_embeddings=False)


def _hf_seq2seq(config_name: str, model_name: str, **fields):
    def builder(gen):
        import transformers

        cfg = _config(config_name, **fields)
        ids, targets = _ids(gen), _ids(gen)
        inputs = {"input_ids": ids, "decoder_input_ids": targets}
        return getattr(transformers, model_name)(cfg), inputs, _logits_loss(_ids(gen))

    return builder


def _hf_images(config_name: str, model_name: str, size: int = 32, **fields):
    def builder(gen):
        import transformers

        cfg = _config(config_name, num_labels=6, **fields)
        pixels = torch.randn(BATCH, 3, size, size, generator=gen)
        labels = torch.randint(0, 6, (BATCH,), generator=gen)
        return getattr(transformers, model_name)(cfg), {"pixel_values": pixels}, _logits_loss(labels)

    return builder


def _bert_like(config_name: str, model_name: str, **fields):
    def builder(gen):
        import transformers

        cfg = _config(
            config_name, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=MLP, max_position_embeddings=2 * SEQ + 2, **fields)
        ids = _ids(gen)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, -3:] = 0
        labels = torch.where(mask.bool(), _ids(gen), -100)
        return getattr(transformers, model_name)(cfg), {"input_ids": ids, "attention_mask": mask}, _logits_loss(labels)

    return builder


# ------------------------------------------------------------------ torch


class _TorchEncoder(nn.Module):
    """torch.nn.TransformerEncoder (packed-QKV MultiheadAttention) with a linear head."""

    def __init__(self, norm_first: bool):
        super().__init__()
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, MLP, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.head(self.encoder(x))


class _TorchTransformer(nn.Module):
    """torch.nn.Transformer, encoder and decoder, with a causal target mask."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(HIDDEN, HEADS, LAYERS, LAYERS, MLP, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device, dtype=tgt.dtype)
        return self.transformer(src, tgt, tgt_mask=mask, tgt_is_causal=True)


def _mean_square(out):
    return out.square().mean()


def _torch_encoder(norm_first: bool):
    def builder(gen):
        return _TorchEncoder(norm_first), (torch.randn(BATCH, SEQ, HIDDEN, generator=gen),), _mean_square

    return builder


def _torch_transformer(gen):
    src, tgt = (torch.randn(BATCH, SEQ, HIDDEN, generator=gen) for _ in range(2))
    return _TorchTransformer(), (src, tgt), _mean_square


def _dtensor_test_transformer(gen):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(n_layers=LAYERS, vocab_size=VOCAB, max_seq_len=SEQ, dim=HIDDEN, n_heads=HEADS, dropout_p=0.0)
    return Transformer(args), (_ids(gen),), _mean_square


ARCHITECTURES: dict[str, tuple[str, Callable]] = {
    # Hugging Face decoders
    "gpt2": ("transformers", _hf_causal("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=HIDDEN,
                                        n_layer=LAYERS, n_head=HEADS, n_inner=MLP, n_positions=2 * SEQ,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("transformers", _hf_causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=HEADS, **_DECODER)),
    "llama-gqa": ("transformers", _hf_causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_DECODER)),
    "mistral": ("transformers", _hf_causal("MistralConfig", "MistralForCausalLM", num_key_value_heads=HEADS, **_DECODER)),
    "qwen2": ("transformers", _hf_causal("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=HEADS, **_DECODER)),
    "qwen3": ("transformers", _hf_causal("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=HEADS, head_dim=8, **_DECODER)),
    "gemma": ("transformers", _hf_causal("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=HEADS, head_dim=8, **_DECODER)),
    "gemma2": ("transformers", _hf_causal("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=HEADS, head_dim=8, **_DECODER)),
    "phi": ("transformers", _hf_causal("PhiConfig", "PhiForCausalLM", **_DECODER)),
    "phi3": ("transformers", _hf_causal("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=HEADS, pad_token_id=0,
                                        **_DECODER)),
    "stablelm": ("transformers", _hf_causal("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=HEADS, **_DECODER)),
    "opt": ("transformers", _hf_causal("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                                      ffn_dim=MLP, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      max_position_embeddings=2 * SEQ, word_embed_proj_dim=HIDDEN, dropout=0.0)),
    "gpt-neo": ("transformers", _hf_causal("GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                                          num_layers=LAYERS, num_heads=HEADS, attention_types=[[["global", "local"], 1]],
                                          max_position_embeddings=2 * SEQ, window_size=4, intermediate_size=MLP)),
    "gptj": ("transformers", _hf_causal("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS,
                                       n_head=HEADS, n_inner=MLP, rotary_dim=4, n_positions=2 * SEQ)),
    "bloom": ("transformers", _hf_causal("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                                        n_layer=LAYERS, n_head=HEADS)),
    "falcon": ("transformers", _hf_causal("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, multi_query=True,
                                         new_decoder_architecture=False, parallel_attn=True, alibi=False)),
    "gpt-bigcode": ("transformers", _hf_causal("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB,
                                              n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=MLP,
                                              n_positions=2 * SEQ, multi_query=True)),
    "gpt-neox": ("transformers", _hf_causal("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5, **_DECODER)),
    "olmo": ("transformers", _hf_causal("OlmoConfig", "OlmoForCausalLM", num_key_value_heads=HEADS, pad_token_id=0,
                                       **_DECODER)),
    "granite": ("transformers", _hf_causal("GraniteConfig", "GraniteForCausalLM", num_key_value_heads=HEADS, **_DECODER)),
    "starcoder2": ("transformers", _hf_causal("Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=HEADS,
                                             **_DECODER)),
    "mpt": ("transformers", _hf_causal("MptConfig", "MptForCausalLM", vocab_size=VOCAB, d_model=HIDDEN, n_heads=HEADS,
                                      n_layers=LAYERS, expansion_ratio=2, max_seq_len=2 * SEQ)),
    "mixtral": ("transformers", _hf_causal("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=HEADS,
                                          num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm",
                                          **_DECODER)),
    # Hugging Face encoders and encoder-decoders
    "bert": ("transformers", _bert_like("BertConfig", "BertForMaskedLM")),
    "roberta": ("transformers", _bert_like("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1)),
    "electra": ("transformers", _bert_like("ElectraConfig", "ElectraForMaskedLM", embedding_size=HIDDEN)),
    "distilbert": ("transformers", _bert_like("DistilBertConfig", "DistilBertForMaskedLM")),
    "t5": ("transformers", _hf_seq2seq("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=HIDDEN,
                                      d_kv=HIDDEN // HEADS, d_ff=MLP, num_layers=LAYERS, num_heads=HEADS,
                                      dropout_rate=0.0, decoder_start_token_id=0)),
    "bart": ("transformers", _hf_seq2seq("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=HIDDEN,
                                        encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                                        decoder_attention_heads=HEADS, encoder_ffn_dim=MLP, decoder_ffn_dim=MLP,
                                        max_position_embeddings=2 * SEQ, dropout=0.0)),
    # Hugging Face vision
    "vit": ("transformers", _hf_images("ViTConfig", "ViTForImageClassification", size=8, image_size=8, patch_size=4,
                                      hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      intermediate_size=MLP)),
    "deit": ("transformers", _hf_images("DeiTConfig", "DeiTForImageClassification", size=8, image_size=8, patch_size=4,
                                       hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                       intermediate_size=MLP)),
    "convnext": ("transformers", _hf_images("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[8, 16],
                                           depths=[1, 1], num_stages=2)),
    "resnet": ("transformers", _hf_images("ResNetConfig", "ResNetForImageClassification", embedding_size=8,
                                         hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
    "mobilenet-v2": ("transformers", _hf_images("MobileNetV2Config", "MobileNetV2ForImageClassification",
                                               depth_multiplier=0.25, image_size=32)),
    # torch
    "torch-encoder": ("torch", _torch_encoder(norm_first=False)),
    "torch-encoder-prenorm": ("torch", _torch_encoder(norm_first=True)),
    "torch-transformer": ("torch", _torch_transformer),
    "dtensor-test-transformer": ("torch", _dtensor_test_transformer),
    **TITAN_ARCHITECTURES,
}


def libraries() -> list[str]:
    return sorted({library for library, _ in ARCHITECTURES.values()})


def build(name: str, dtype: torch.dtype = torch.float64) -> Case:
    """The case `name`, in `dtype`, the same in every process."""
    seed = zlib.crc32(name.encode())
    torch.manual_seed(seed)  # model code initialises weights from the global generator
    gen = torch.Generator().manual_seed(seed + 1)
    model, inputs, loss = ARCHITECTURES[name][1](gen)
    model = model.to(dtype).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    with torch.no_grad():  # offset 1-D parameters so that no two shards look alike
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    cast = (lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
    inputs = {k: cast(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(map(cast, inputs))
    return Case(model, inputs, loss)
