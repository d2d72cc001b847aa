"""Sharded generation: `generate` on a compiled transformers causal LM, its KV cache kept sharded.

`cache_step` is the model's forward with the cache as tensors (what the
generation programs compile); `prepare` reads a `generate` call as transformers
takes it (settings, logits processors, stopping criteria); `generate` compiles
the prefill and decode programs on the model's shards and decodes or samples as
transformers does (docs/generation.md).
"""
