"""A zoo of small architectures from third-party model code, for coverage checks.

`ARCHITECTURES` maps a name to `Architecture(library, builder, usage)`;
`build(name, call)` returns `Case(model, inputs, loss, own_loss)`: a model
from a tiny config with random weights (nothing is downloaded), float64,
keyword or positional inputs of batch 4 (a multiple of d*q at [2,2,2]), and
`loss(output) -> scalar`. Every model has 4 attention heads (hidden 32), so
heads divide both q=2 and p=4. Weights and inputs come from seeded
generators: the same name builds the same weights in every process and for
every call.

A call is one way the model's users call it (`calls(name)` lists those that
apply, by the model's `Usage`):

- `default`: the zoo's own call, every dropout probability 0, no cache, inputs
  the model needs and no more (seq2seq models get `decoder_input_ids`);
- `labels`: the model derives inputs from `labels` (a causal LM shifts them for
  its own loss; a seq2seq model shifts them right into its decoder inputs and
  gets a right-padded `attention_mask`); labels end in -100 in two rows, as a
  collator pads them; `own_loss`: the output's `.loss` is compared too;
- `padded`: a padded `attention_mask` (left padding for decoders, right for
  encoders; BERT-like models pad in their default call already);
- `train`, `eval`: the config's defaults (dropout at its probabilities, the
  cache as the config sets it), in train mode and after `model.eval()`;
- `tokens` (causal LMs): one sequence, the labels call's row that pads 3
  positions, with the padded `attention_mask` of the model's side: a batch of
  one, whose tokens split over the mesh (`token_split`, docs/modes.md).

Libraries: Hugging Face transformers, torch itself (`torch.nn` layers and
the Transformer of PyTorch's tensor-parallel tests) and torchtitan
(`benchmarks/titan_architectures.py`). Mixtral's and DeepSeek's experts use
transformers' `batched_mm` implementation: the eager one loops over the
experts a batch routes to (data-dependent, not capturable), `grouped_mm` has
no float64. Each is imported when one of its models is built; a missing
library raises ImportError, so callers can skip its models.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.titan_architectures import TITAN_ARCHITECTURES

__all__ = ["ARCHITECTURES", "CALL_NAMES", "Architecture", "Case", "LogitsLoss", "Usage", "build", "calls", "libraries"]

HIDDEN, HEADS, LAYERS, VOCAB, SEQ, BATCH, MLP = 32, 4, 2, 64, 8, 4, 64
CALL_NAMES = ("default", "labels", "padded", "train", "eval", "tokens")
PADDED = {1: 3, 2: 1}  # batch row -> positions padded (mask 0, label -100) in the labels and padded calls
TOKENS_ROW = 1  # the batch row the tokens call keeps


@dataclass(frozen=True)
class Usage:
    """How a model's users call it, beyond the default call: which calls apply.

    `labels`: "next" (a causal LM shifts them for its own loss) or "decoder" (a seq2seq model
    derives its decoder inputs from them); `padding`: the side a padded `attention_mask` pads
    ("left", "right"; None where the model takes none or its default call pads); `config`: the
    model has a config (or module) whose dropout and cache defaults the train and eval calls keep.
    """

    labels: str | None = None
    padding: str | None = None
    config: bool = False


class Architecture(NamedTuple):
    library: str
    builder: Callable  # builder(gen[, defaults=True]) -> (model, inputs, loss)
    usage: Usage = Usage()


@dataclass
class Case:
    model: nn.Module
    inputs: object  # a tuple of positional inputs or a dict of keyword inputs
    loss: Callable
    own_loss: bool = False  # compare the output's `.loss` too (the model's own loss)


@dataclass(frozen=True)
class LogitsLoss:
    """Cross-entropy of the output's logits against `labels`, in the logits' dtype (transformers'
    own losses upcast to float32, which would hide float64 errors); with `shift`, position t is
    scored against `labels[:, t + 1]`, as a causal LM's own loss is."""

    labels: torch.Tensor
    shift: bool = False

    def __call__(self, out):
        logits, labels = out.logits, self.labels
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


_CAUSAL = Usage(labels="next", padding="left", config=True)
# Eager attention whose softmax casts the scores to float32, where a float64 mask's minimum is -inf:
# a fully masked row (a left pad) gives NaN in the unsharded model, so these pad on the right
_CAUSAL_SOFTMAX32 = Usage(labels="next", padding="right", config=True)
_SEQ2SEQ = Usage(labels="decoder", config=True)  # its labels call pads the encoder's attention_mask
_MIXER = Usage(labels="next", padding="right")  # recurrent mixers: labels and a padded mask, no config calls
_ENCODER = Usage(padding="right", config=True)
_CONFIG_ONLY = Usage(config=True)  # images; BERT-like models, whose default call pads already


def _ids(gen, vocab=VOCAB, shape=(BATCH, SEQ)):
    return torch.randint(0, vocab, shape, generator=gen)


def _padding_mask(side: str) -> torch.Tensor:
    """An `attention_mask` of `PADDED`'s rows padded on `side`."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    for row, count in PADDED.items():
        if side == "left":
            mask[row, :count] = 0
        else:
            mask[row, SEQ - count:] = 0
    return mask


def _config(name: str, defaults: bool = False, **fields):
    """A transformers config: with `defaults`, as `fields` leave it; else with every dropout,
    drop-path and layer-drop probability 0 and no cache."""
    import transformers

    cfg = getattr(transformers, name)(**fields)
    if defaults:
        return cfg
    for key, value in vars(cfg).items():
        if isinstance(value, float) and any(word in key for word in ("dropout", "pdrop", "drop_path", "layerdrop")):
            setattr(cfg, key, 0.0)
    cfg.use_cache = False
    return cfg


def _hf_causal(config_name: str, model_name: str, usage: Usage = _CAUSAL, **fields) -> Architecture:
    """A causal LM from `fields`: ids in, cross-entropy against random labels."""

    def builder(gen, defaults=False):
        import transformers

        cfg = _config(config_name, defaults, **fields)
        ids = _ids(gen, cfg.vocab_size)
        return getattr(transformers, model_name)(cfg), {"input_ids": ids}, LogitsLoss(_ids(gen, cfg.vocab_size))

    return Architecture("transformers", builder, usage)


_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=2 * SEQ, tie_word_embeddings=False)
_T5 = dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=MLP, num_layers=LAYERS, num_heads=HEADS,
           decoder_start_token_id=0)
_BART = dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
             encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=MLP, decoder_ffn_dim=MLP,
             max_position_embeddings=2 * SEQ)


def _hf_seq2seq(config_name: str, model_name: str, mask: bool = False, **fields) -> Architecture:
    """An encoder-decoder from `fields`: ids and decoder ids in (and with `mask` an attention_mask
    of ones), cross-entropy against random labels."""

    def builder(gen, defaults=False):
        import transformers

        cfg = _config(config_name, defaults, **fields)
        inputs = {"input_ids": _ids(gen), "decoder_input_ids": _ids(gen)}
        if mask:
            inputs["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        return getattr(transformers, model_name)(cfg), inputs, LogitsLoss(_ids(gen))

    return Architecture("transformers", builder, _SEQ2SEQ)


def _hf_images(config_name: str, model_name: str, size: int = 32, **fields) -> Architecture:
    """An image classifier from `fields`: random pixels in, cross-entropy against 6 random classes."""

    def builder(gen, defaults=False):
        import transformers

        cfg = _config(config_name, defaults, num_labels=6, **fields)
        pixels = torch.randn(BATCH, 3, size, size, generator=gen)
        labels = torch.randint(0, 6, (BATCH,), generator=gen)
        return getattr(transformers, model_name)(cfg), {"pixel_values": pixels}, LogitsLoss(labels)

    return Architecture("transformers", builder, _CONFIG_ONLY)


def _bert_like(config_name: str, model_name: str, **fields) -> Architecture:
    """A masked LM: ids and a right-padded attention_mask in, cross-entropy against random labels."""

    def builder(gen, defaults=False):
        import transformers

        cfg = _config(
            config_name, defaults, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=MLP, max_position_embeddings=2 * SEQ + 2, **fields)
        ids = _ids(gen)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, -3:] = 0
        labels = torch.where(mask.bool(), _ids(gen), -100)
        return getattr(transformers, model_name)(cfg), {"input_ids": ids, "attention_mask": mask}, LogitsLoss(labels)

    return Architecture("transformers", builder, _CONFIG_ONLY)


# ------------------------------------------------------------------ torch

_TORCH_DROPOUT = 0.1  # torch's default for nn.TransformerEncoderLayer, nn.Transformer and the TP test's ModelArgs


class _TorchEncoder(nn.Module):
    """torch.nn.TransformerEncoder (packed-QKV MultiheadAttention) with a linear head; an optional
    `attention_mask` (1 keep, 0 pad) is its `src_key_padding_mask`."""

    def __init__(self, norm_first: bool, dropout: float):
        super().__init__()
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, MLP, dropout=dropout, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, attention_mask=None):
        pads = None if attention_mask is None else attention_mask == 0
        return self.head(self.encoder(x, src_key_padding_mask=pads))


class _TorchTransformer(nn.Module):
    """torch.nn.Transformer, encoder and decoder, with a causal target mask; an optional
    `attention_mask` (1 keep, 0 pad) masks the padded source positions in both attentions to them."""

    def __init__(self, dropout: float):
        super().__init__()
        self.transformer = nn.Transformer(HIDDEN, HEADS, LAYERS, LAYERS, MLP, dropout=dropout, batch_first=True)

    def forward(self, src, tgt, attention_mask=None):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device, dtype=tgt.dtype)
        pads = None if attention_mask is None else attention_mask == 0
        return self.transformer(src, tgt, tgt_mask=mask, tgt_is_causal=True, src_key_padding_mask=pads,
                                memory_key_padding_mask=pads)


def _mean_square(out):
    return out.square().mean()


def _torch_encoder(norm_first: bool):
    def builder(gen, defaults=False):
        model = _TorchEncoder(norm_first, _TORCH_DROPOUT if defaults else 0.0)
        return model, (torch.randn(BATCH, SEQ, HIDDEN, generator=gen),), _mean_square

    return builder


def _torch_transformer(gen, defaults=False):
    src, tgt = (torch.randn(BATCH, SEQ, HIDDEN, generator=gen) for _ in range(2))
    return _TorchTransformer(_TORCH_DROPOUT if defaults else 0.0), (src, tgt), _mean_square


def _dtensor_test_transformer(gen, defaults=False):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(n_layers=LAYERS, vocab_size=VOCAB, max_seq_len=SEQ, dim=HIDDEN, n_heads=HEADS,
                     dropout_p=_TORCH_DROPOUT if defaults else 0.0)
    return Transformer(args), (_ids(gen),), _mean_square


_LATENT_ATTENTION = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
                         num_key_value_heads=HEADS, experts_implementation="batched_mm", **_DECODER)

ARCHITECTURES: dict[str, Architecture] = {
    # Hugging Face decoders
    "gpt2": _hf_causal("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                       n_inner=MLP, n_positions=2 * SEQ),
    "llama": _hf_causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=HEADS, **_DECODER),
    "llama-gqa": _hf_causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_DECODER),
    "mistral": _hf_causal("MistralConfig", "MistralForCausalLM", num_key_value_heads=HEADS, **_DECODER),
    "qwen2": _hf_causal("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=HEADS, **_DECODER),
    "qwen3": _hf_causal("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=HEADS, head_dim=8, **_DECODER),
    "gemma": _hf_causal("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=HEADS, head_dim=8, **_DECODER),
    "gemma2": _hf_causal("Gemma2Config", "Gemma2ForCausalLM", _CAUSAL_SOFTMAX32, num_key_value_heads=HEADS, head_dim=8,
                         **_DECODER),
    "phi": _hf_causal("PhiConfig", "PhiForCausalLM", **_DECODER),
    "phi3": _hf_causal("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=HEADS, pad_token_id=0, **_DECODER),
    "stablelm": _hf_causal("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=HEADS, **_DECODER),
    "opt": _hf_causal("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=MLP,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=2 * SEQ,
                      word_embed_proj_dim=HIDDEN),
    "gpt-neo": _hf_causal("GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                          num_heads=HEADS, attention_types=[[["global", "local"], 1]], max_position_embeddings=2 * SEQ,
                          window_size=4, intermediate_size=MLP),
    "gptj": _hf_causal("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                       n_inner=MLP, rotary_dim=4, n_positions=2 * SEQ),
    "bloom": _hf_causal("BloomConfig", "BloomForCausalLM", _CAUSAL_SOFTMAX32, vocab_size=VOCAB, hidden_size=HIDDEN,
                        n_layer=LAYERS, n_head=HEADS),
    "falcon": _hf_causal("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, multi_query=True,
                         new_decoder_architecture=False, parallel_attn=True, alibi=False),
    "gpt-bigcode": _hf_causal("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB, n_embd=HIDDEN,
                              n_layer=LAYERS, n_head=HEADS, n_inner=MLP, n_positions=2 * SEQ, multi_query=True),
    "gpt-neox": _hf_causal("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5, **_DECODER),
    "olmo": _hf_causal("OlmoConfig", "OlmoForCausalLM", num_key_value_heads=HEADS, pad_token_id=0, **_DECODER),
    "granite": _hf_causal("GraniteConfig", "GraniteForCausalLM", num_key_value_heads=HEADS, **_DECODER),
    "starcoder2": _hf_causal("Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=HEADS, **_DECODER),
    "mpt": _hf_causal("MptConfig", "MptForCausalLM", _CAUSAL_SOFTMAX32, vocab_size=VOCAB, d_model=HIDDEN, n_heads=HEADS,
                      n_layers=LAYERS, expansion_ratio=2, max_seq_len=2 * SEQ),
    "mixtral": _hf_causal("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=HEADS, num_local_experts=4,
                          num_experts_per_tok=2, experts_implementation="batched_mm", **_DECODER),
    # multi-head latent attention, routed and shared experts; V3 compresses q too and routes by groups
    "deepseek-v2": _hf_causal("DeepseekV2Config", "DeepseekV2ForCausalLM", q_lora_rank=None, **_LATENT_ATTENTION),
    "deepseek-v3": _hf_causal("DeepseekV3Config", "DeepseekV3ForCausalLM", q_lora_rank=16, n_group=2, topk_group=1,
                              **_LATENT_ATTENTION),
    # time-shift mixing and a recurrence in place of attention; no attention_mask (RWKV ignores it)
    "rwkv": _hf_causal("RwkvConfig", "RwkvForCausalLM", Usage(labels="next", config=True), vocab_size=VOCAB,
                       hidden_size=HIDDEN, num_hidden_layers=LAYERS, attention_hidden_size=HIDDEN,
                       intermediate_size=MLP, context_length=2 * SEQ, rescale_every=0),
    # sequence mixers without attention: Mamba's selective scan (a depthwise causal conv, then a scan over
    # the sequence), Mamba-2's chunked state-space duality, Qwen3-Next's chunked gated delta rule (linear
    # attention) beside full attention; padded positions are zeroed before each mixer
    "mamba": _hf_causal("MambaConfig", "MambaForCausalLM", _MIXER, vocab_size=VOCAB, hidden_size=HIDDEN,
                        state_size=8, num_hidden_layers=LAYERS, expand=2, conv_kernel=4, time_step_rank=4),
    "mamba2": _hf_causal("Mamba2Config", "Mamba2ForCausalLM", _MIXER, vocab_size=VOCAB, hidden_size=HIDDEN,
                         state_size=8, num_hidden_layers=LAYERS, expand=2, conv_kernel=4, num_heads=8, head_dim=8,
                         n_groups=2, chunk_size=4),
    "qwen3-next": _hf_causal("Qwen3NextConfig", "Qwen3NextForCausalLM", _MIXER, head_dim=8, num_key_value_heads=2,
                             linear_num_value_heads=HEADS, linear_num_key_heads=2, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             experts_implementation="batched_mm", **_DECODER),
    # Hugging Face encoders (DeBERTa-v2: disentangled relative-position attention)
    "bert": _bert_like("BertConfig", "BertForMaskedLM"),
    "roberta": _bert_like("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1),
    "electra": _bert_like("ElectraConfig", "ElectraForMaskedLM", embedding_size=HIDDEN),
    "distilbert": _bert_like("DistilBertConfig", "DistilBertForMaskedLM"),
    "deberta-v2": _bert_like("DebertaV2Config", "DebertaV2ForMaskedLM", relative_attention=True,
                             pos_att_type=["p2c", "c2p"], position_buckets=4, max_relative_positions=SEQ),
    # Hugging Face encoder-decoders (T5, UMT5, LongT5: a learned relative-position bias on the scores)
    "t5": _hf_seq2seq("T5Config", "T5ForConditionalGeneration", **_T5),
    "umt5": _hf_seq2seq("UMT5Config", "UMT5ForConditionalGeneration", **_T5),
    # LongT5's encoder makes no mask of its own under torch.export (transformers skips it while compiling)
    "long-t5": _hf_seq2seq("LongT5Config", "LongT5ForConditionalGeneration", mask=True, local_radius=2, **_T5),
    "bart": _hf_seq2seq("BartConfig", "BartForConditionalGeneration", **_BART),
    "mbart": _hf_seq2seq("MBartConfig", "MBartForConditionalGeneration", **_BART),
    "pegasus": _hf_seq2seq("PegasusConfig", "PegasusForConditionalGeneration", **_BART),
    "marian": _hf_seq2seq("MarianConfig", "MarianMTModel", decoder_vocab_size=VOCAB, pad_token_id=VOCAB - 1,
                          decoder_start_token_id=VOCAB - 1, **_BART),
    # Hugging Face vision (Swin: windowed attention with a learned relative-position bias)
    "vit": _hf_images("ViTConfig", "ViTForImageClassification", size=8, image_size=8, patch_size=4,
                      hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=MLP),
    "deit": _hf_images("DeiTConfig", "DeiTForImageClassification", size=8, image_size=8, patch_size=4,
                       hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=MLP),
    "swin": _hf_images("SwinConfig", "SwinForImageClassification", size=16, image_size=16, patch_size=2,
                       embed_dim=HIDDEN, depths=[2], num_heads=[HEADS], window_size=4),
    "convnext": _hf_images("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[8, 16], depths=[1, 1],
                           num_stages=2),
    "resnet": _hf_images("ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16],
                         depths=[1, 1], layer_type="basic"),
    "mobilenet-v2": _hf_images("MobileNetV2Config", "MobileNetV2ForImageClassification", depth_multiplier=0.25,
                               image_size=32),
    # torch
    "torch-encoder": Architecture("torch", _torch_encoder(norm_first=False), _ENCODER),
    "torch-encoder-prenorm": Architecture("torch", _torch_encoder(norm_first=True), _ENCODER),
    "torch-transformer": Architecture("torch", _torch_transformer, _ENCODER),
    "dtensor-test-transformer": Architecture("torch", _dtensor_test_transformer, _CONFIG_ONLY),
    **{name: Architecture(*entry) for name, entry in TITAN_ARCHITECTURES.items()},
}


def libraries() -> list[str]:
    return sorted({arch.library for arch in ARCHITECTURES.values()})


def calls(name: str) -> list[str]:
    """The calls of `CALL_NAMES` that `name`'s users make (the module docstring)."""
    usage = ARCHITECTURES[name].usage
    made = {"default": True, "labels": usage.labels is not None, "padded": usage.padding is not None,
            "train": usage.config, "eval": usage.config, "tokens": usage.labels == "next"}
    return [call for call in CALL_NAMES if made[call]]


def build(name: str, call: str = "default", dtype: torch.dtype = torch.float64) -> Case:
    """The case `name` called as `call`, in `dtype`, the same in every process."""
    if call not in calls(name):
        raise ValueError(f"{name} has no call {call!r}: its calls are {calls(name)}")
    usage = ARCHITECTURES[name].usage
    model, inputs, loss = _built(name, defaults=call in ("train", "eval"), dtype=dtype)
    case = Case(model.train(call != "eval"), inputs, loss)
    if call == "labels":
        return _with_labels(case, usage.labels)
    if call == "padded":
        return _padded(case, usage.padding)
    if call == "tokens":
        case = _with_labels(case, usage.labels)
        case = dataclasses.replace(_padded(case, usage.padding), own_loss=True) if usage.padding else case
        return _one_sequence(case, TOKENS_ROW)
    return case


def _built(name: str, defaults: bool, dtype: torch.dtype) -> tuple[nn.Module, object, Callable]:
    """`name`'s builder run from its seeds, the model and floating inputs cast to `dtype`; without
    `defaults`, every dropout module at p=0."""
    seed = zlib.crc32(name.encode())
    torch.manual_seed(seed)  # model code initialises weights from the global generator
    gen = torch.Generator().manual_seed(seed + 1)
    builder = ARCHITECTURES[name].builder
    model, inputs, loss = builder(gen, defaults=True) if defaults else builder(gen)
    model = model.to(dtype)
    dropouts = [] if defaults else [module for module in model.modules() if isinstance(module, nn.Dropout)]
    for module in dropouts:
        module.p = 0.0
    with torch.no_grad():  # offset 1-D parameters so that no two shards look alike
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    cast = (lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
    inputs = {k: cast(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(map(cast, inputs))
    return model, inputs, loss


def _with_labels(case: Case, use: str) -> Case:
    """The call with `labels` (right-padded with -100) in place of the targets the zoo scores;
    `use` "decoder": in place of the decoder ids, with a right-padded attention_mask."""
    labels = case.loss.labels.masked_fill(_padding_mask("right") == 0, -100)
    inputs = {key: value for key, value in case.inputs.items() if key != "decoder_input_ids"}
    if use == "decoder":
        inputs["attention_mask"] = _padding_mask("right")
    loss = LogitsLoss(labels, shift=use == "next")
    return Case(case.model, {**inputs, "labels": labels}, loss, own_loss=True)


def _one_sequence(case: Case, row: int) -> Case:
    """The call on batch row `row` alone: every input and the scored labels of batch `BATCH` cut to it."""
    def cut(value):
        return value[row:row + 1] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == BATCH \
            else value

    inputs = {k: cut(v) for k, v in case.inputs.items()} if isinstance(case.inputs, dict) else tuple(map(cut, case.inputs))
    loss = dataclasses.replace(case.loss, labels=cut(case.loss.labels))
    return Case(case.model, inputs, loss, case.own_loss)


def _padded(case: Case, side: str) -> Case:
    """The call with an `attention_mask` padded on `side`; padded positions are not scored."""
    mask = _padding_mask(side)
    inputs = {**case.inputs, "attention_mask": mask} if isinstance(case.inputs, dict) else (*case.inputs, mask)
    loss = case.loss
    if isinstance(loss, LogitsLoss):
        loss = dataclasses.replace(loss, labels=loss.labels.masked_fill(mask == 0, -100))
    return Case(case.model, inputs, loss)
