"""A sharded `generate` call prepared as transformers' `GenerationMixin.generate` prepares it.

The unsharded model's own methods do the work: the generation config
(`_prepare_generation_config`), the prompt, its attention mask and position
ids, their expansion for `num_return_sequences`, the lengths, and the logits
processors and stopping criteria (`_get_logits_processor`,
`_get_stopping_criteria`), so that the sharded loop decodes with what
`model.generate(...)` would. What the loop does not do is a ValueError that
names the setting, the mesh and the fix, before anything runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tess_compile.core.mesh import Mesh

__all__ = ["Call", "prepare_call"]

log = logging.getLogger("tess_compile")

# GenerationConfig fields the sharded loop honours: lengths and stopping, special tokens, sampling, the
# logits processors transformers builds from the config, and the outputs it returns.
_HONOURED = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "max_time", "stop_strings",
    "eos_token_id", "pad_token_id", "bos_token_id", "do_sample", "num_return_sequences", "use_cache",
    "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "sequence_bias", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "renormalize_logits",
    "watermarking_config", "return_dict_in_generate", "output_scores", "output_logits",
    "early_stopping", "length_penalty",  # beam settings, which transformers ignores without beams
})


@dataclass
class Call:
    """One generate call, prepared: its config (lengths final, special tokens as tensors), the prompt
    [batch, length] (expanded for num_return_sequences), its attention mask and position ids (as
    transformers derives them), and the logits processors and stopping criteria."""

    config: object  # transformers.GenerationConfig
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    processors: object  # transformers.LogitsProcessorList
    criteria: object  # transformers.StoppingCriteriaList


def prepare_call(model: nn.Module, mesh: Mesh, inputs, generation_config, kwargs: dict, logits_processor=None,
                 stopping_criteria=None, prefix_allowed_tokens_fn=None) -> Call:
    """The call `model.generate(inputs, generation_config, logits_processor, stopping_criteria,
    prefix_allowed_tokens_fn, **kwargs)` would decode, for the sharded loop on `mesh`."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    tokenizer = kwargs.pop("tokenizer", None)  # for stop_strings, as transformers takes it
    defaults = _default_lengths(model, generation_config, kwargs)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _refuse_settings(model, config, mesh)
    prompt, ids, expanded = _inputs(model, config, inputs, model_kwargs, mesh)
    length = ids.shape[1]
    config = model._prepare_generated_length(config, *defaults, model_input_name="input_ids",
                                             inputs_tensor=prompt, input_ids_length=length)
    model._validate_generated_length(config, length, defaults[0])
    padded = not bool((expanded["attention_mask"] == 1).all())  # transformers drops a mask of ones
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=length, encoder_input_ids=prompt,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, logits_processor=logits_processor or LogitsProcessorList(),
        device=prompt.device, model_kwargs={"attention_mask": expanded["attention_mask"] if padded else None})
    criteria = model._get_stopping_criteria(generation_config=config,
                                            stopping_criteria=stopping_criteria or StoppingCriteriaList(),
                                            tokenizer=tokenizer)
    return Call(config, ids, expanded["attention_mask"], expanded["position_ids"], processors, criteria)


def _inputs(model: nn.Module, config, inputs, model_kwargs: dict, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The prompt as given, the prompt expanded for num_return_sequences, and its attention mask and
    position ids (expanded alike); the config's special tokens made tensors."""
    prompt, name, model_kwargs = model._prepare_model_inputs(inputs, config.bos_token_id, model_kwargs)
    mask = model_kwargs.pop("attention_mask", None)
    _refuse_arguments(name, prompt, mask, model_kwargs, mesh)
    model._prepare_special_tokens(config, mask is not None, device=prompt.device, batch_size=prompt.shape[0])
    if mask is None:
        mask = model._prepare_attention_mask_for_generation(prompt, config, {})
    mask = mask.to(torch.long)  # the dtype the programs take
    _warn_right_padding(config, prompt, mask)
    positions = model._prepare_position_ids_for_generation(prompt, {"attention_mask": mask})
    ids, expanded = model._expand_inputs_for_generation(
        input_ids=prompt, expand_size=config.num_return_sequences, attention_mask=mask, position_ids=positions)
    return prompt, ids, expanded


def _default_lengths(model: nn.Module, generation_config, kwargs: dict) -> tuple[bool, bool]:
    """Whether max_length and min_length are left at their defaults (transformers reads this before
    it merges the configs)."""
    return tuple(kwargs.get(key) is None and getattr(generation_config, key, None) is None
                 and getattr(model.generation_config, key) is None for key in ("max_length", "min_length"))


def _refuse_settings(model: nn.Module, config, mesh: Mesh) -> None:
    """ValueError for beams and for any generation setting the sharded loop does not honour (one that
    differs from transformers' defaults)."""
    where = f"generate on mesh {mesh}"
    if config.num_beams is not None and config.num_beams > 1:
        raise ValueError(f"{where}: num_beams={config.num_beams} asks for beam search, which sharded generation "
                         "does not do (it samples or decodes greedily): generate with the unsharded model "
                         "(model.generate) for beams, or pass num_beams=1")
    from transformers import GenerationConfig

    neutral = {**GenerationConfig().to_dict(), **model.generation_config._get_default_generation_params()}
    asked = {key: value for key, value in config.to_dict().items()
             if not key.startswith("_") and key != "transformers_version" and key not in _HONOURED
             and value != neutral.get(key) and not (_unset(value) and _unset(neutral.get(key)))}
    if asked:
        raise ValueError(f"{where}: generation settings {asked} are not supported by sharded generation (it samples "
                         "or decodes greedily with transformers' logits processors and stopping criteria): "
                         "generate with the unsharded model for them")


def _unset(value) -> bool:
    """None and False alike: a flag transformers' defaults leave unset (output_attentions)."""
    return value is None or value is False


def _refuse_arguments(name: str, prompt, mask, model_kwargs: dict, mesh: Mesh) -> None:
    """ValueError for a prompt other than input_ids [batch, length] and for model arguments besides
    the attention mask."""
    where = f"generate on mesh {mesh}"
    if name != "input_ids" or prompt.dim() != 2 or prompt.is_floating_point():
        raise ValueError(f"{where}: pass the prompt as input_ids, a tensor [batch, length] of token ids")
    unused = sorted(key for key, value in model_kwargs.items() if value is not None)
    if unused:
        raise ValueError(f"{where}: arguments {unused} are not supported by sharded generation, which takes the "
                         "prompt (input_ids), its attention_mask, the generation settings, logits_processor, "
                         "stopping_criteria, prefix_allowed_tokens_fn, streamer and tokenizer: leave them out")
    if mask is not None and tuple(mask.shape) != tuple(prompt.shape):
        raise ValueError(f"{where}: attention_mask has shape {list(mask.shape)}, but the prompt has "
                         f"{list(prompt.shape)}: pass a mask [batch, length] of the prompt's tokens")


def _warn_right_padding(config, prompt: torch.Tensor, mask: torch.Tensor) -> None:
    """transformers' warning for right padding, which decoder-only generation does not expect (the
    tokens are then those of the unsharded model, as transformers generates them)."""
    if config._pad_token_tensor is not None and prompt.shape[0] > 1 and bool((mask[:, -1] == 0).any()):
        log.warning("generate: right padding detected in the attention mask: a decoder-only model generates "
                    "correctly only from left-padded prompts; set padding_side='left' on the tokenizer")
