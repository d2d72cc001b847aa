"""A causal LM's forward on a KV cache given as tensors, which a program can take and return.

transformers keeps the cache in a `DynamicCache` object that the model
updates in place. `CacheStep` builds that object from tensors, runs the
model on it, and returns the cache's tensors with the new tokens appended:
an input and an output that a compiled program carries from one step to the
next (`tess_compile.passes.driver.compile_model(..., carried=...)`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["CacheStep", "is_causal_lm"]


def is_causal_lm(model: nn.Module) -> bool:
    """True for a transformers model with a language-model head that `generate` can run."""
    try:
        from transformers import GenerationMixin, PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and isinstance(model, GenerationMixin) and not model.config.is_encoder_decoder


class CacheStep(nn.Module):
    """`model` on `input_ids` [batch, new] after the cached tokens `past`, one `(keys, values)` per
    layer, each [batch, kv heads, cached, head dim] (cached may be 0), with the `attention_mask` of the
    cached and new tokens [batch, cached + new] and the new tokens' `position_ids` [batch, new], as
    transformers' `prepare_inputs_for_generation` passes them (and `cache_position` to a remote-code
    model that takes it). Returns the logits of the last position [batch, vocab] and the cache with
    the new tokens appended, in the same form.

    It shares the model's submodules, parameters and buffers, under the model's own names: the
    programs compiled from it run on the shards of the model's program.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self._modules, self._parameters, self._buffers = model._modules, model._parameters, model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.__dict__["_causal_lm"] = model  # not a submodule: its children are this module's
        self.training = model.training  # the model's mode, which compiling in another restores
        names = inspect.signature(model.forward).parameters
        self._cache_keyword = "cache" if "cache" in names else "past_key_values"
        self._keep_last = "logits_to_keep" in names
        self._takes_positions = "position_ids" in names
        self._cache_positions = "cache_position" in names and model.is_remote_code()

    def train(self, mode: bool = True) -> CacheStep:
        self._causal_lm.training = mode
        return super().train(mode)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past: tuple[tuple[torch.Tensor, torch.Tensor], ...]):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=list(past), config=self._causal_lm.config)
        keywords = {self._cache_keyword: cache, "use_cache": True, "attention_mask": attention_mask}
        if self._takes_positions:
            keywords["position_ids"] = position_ids
        if self._cache_positions:
            cached = cache.get_seq_length()
            keywords["cache_position"] = torch.arange(cached, cached + input_ids.shape[1], device=input_ids.device)
        if self._keep_last:
            keywords["logits_to_keep"] = 1
        logits = self._causal_lm(input_ids=input_ids, **keywords).logits[:, -1]
        return logits, tuple((layer.keys, layer.values) for layer in cache.layers)
