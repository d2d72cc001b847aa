"""Greedy generation on a compiled causal LM's shards, its KV cache sharded and never gathered.

Two programs of `CacheStep` (the model's forward on a cache given as tensors),
both `dynamic=True` in the batch, the new tokens and the cached length:

- prefill: two or more new tokens after a cache of any length (0 too);
- decode: one new token. transformers' attention takes another path for one
  query (no causal mask), so the length of the new tokens is fixed there.

Each is compiled once (`compile_for`, with the module's options and cluster),
on the first `generate`, in eval mode, on the very shards of the module
`shard` or `simulate` returned (their parameters must be laid out alike:
checked). The cache is carried from step to step as each
rank's block (`compile_model(..., carried=...)`): batch over depth and row,
heads over col, as the attention lays out its keys and values; only the
last position's logits are gathered, for the next token. No program is
compiled per token.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from torch import nn

from tess_compile.analysis.compile_entry import compile_for
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import CompileOptions
from tess_compile.core.program import Program
from tess_compile.generation.cache_step import CacheStep

__all__ = ["Generation"]

log = logging.getLogger("tess_compile")

_DEFAULT_MAX_LENGTH = 20  # transformers' default when neither max_length nor max_new_tokens is given
# GenerationConfig fields this greedy loop honours (sampling fields are ignored without do_sample, as transformers does).
_HONOURED = {
    "max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "output_logits",
    "output_scores", "return_dict_in_generate", "temperature", "top_k", "top_p", "output_attentions",
    "output_hidden_states",
}
_GREEDY = {"do_sample": (None, False), "num_beams": (None, 1)}  # the values of these that decode greedily
_CACHED_DIM = 2  # [batch, kv heads, cached, head dim]


class Generation:
    """`generate` for a module compiled from `model` (a transformers causal LM) with `dynamic=True`."""

    def __init__(self, model: nn.Module, mesh: Mesh, options: CompileOptions, cluster: Cluster):
        self.model, self.mesh, self.options, self.cluster = model, mesh, options, cluster
        self.programs: tuple[Program, Program] | None = None  # prefill and decode, on the module's shards

    def generate(self, module, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """`model.generate(...)` on `module`'s shards: greedy decoding; returns the sequences, or a
        `GenerateDecoderOnlyOutput` with `return_dict_in_generate=True` (`logits` and `scores` per step)."""
        config, ids = self._config(generation_config, inputs, kwargs)
        prefill, decode = self._compiled(module, ids)
        batch, length = ids.shape
        if config.max_new_tokens is not None:
            new = config.max_new_tokens
        else:
            new = (config.max_length or _DEFAULT_MAX_LENGTH) - length
        eos = _token_ids(config.eos_token_id)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
        _check_positions(prefill, batch, length, new)
        blocks = {r: _empty_cache(prefill, batch) for r in module.rank_modules()}
        unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
        step_ids, all_logits = ids, []
        with torch.no_grad():
            for _ in range(max(new, 0)):
                program = prefill if step_ids.shape[1] > 1 else decode
                logits, blocks = _step(module, program, step_ids, blocks)
                all_logits.append(logits)
                token = logits.argmax(-1).to(ids.device)
                if eos:
                    token = torch.where(unfinished, token, torch.full_like(token, pad))
                    unfinished &= ~torch.isin(token, torch.tensor(eos, device=ids.device))
                ids = torch.cat([ids, token[:, None]], dim=1)
                step_ids = token[:, None]
                if eos and not unfinished.any():
                    break
        if not config.return_dict_in_generate:
            return ids
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        logits = tuple(all_logits)
        return GenerateDecoderOnlyOutput(sequences=ids, logits=logits if config.output_logits else None,
                                         scores=logits if config.output_scores else None)

    def _config(self, generation_config, inputs, kwargs):
        """The generation config of this call (the model's, updated by `kwargs`) and the prompt; a
        ValueError for what this greedy loop does not do."""
        config = copy.deepcopy(generation_config if generation_config is not None else self.model.generation_config)
        unused = config.update(**kwargs)
        ids = unused.pop("input_ids", inputs)
        mask = unused.pop("attention_mask", None)
        where = f"generate on mesh {self.mesh}"
        if unused:
            raise ValueError(f"{where}: arguments {sorted(unused)} are not supported by sharded generation "
                             "(greedy, no logits processors, streamers or stopping criteria): leave them out")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"{where}: pass the prompt as input_ids, a tensor [batch, length] of token ids")
        if mask is not None and not bool((mask == 1).all()):
            raise ValueError(f"{where}: attention_mask masks some prompt tokens (padding), which sharded "
                             "generation does not take yet: generate prompts of one length together, unpadded")
        asked = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")
                 and k != "transformers_version" and k not in _HONOURED and v not in _GREEDY.get(k, ())}
        if asked:
            raise ValueError(f"{where}: generation settings {asked} are not supported by sharded generation, "
                             "which decodes greedily (do_sample=False, num_beams=1) without logits processors: "
                             "generate with the unsharded model for them")
        return config, ids

    def _compiled(self, module, ids: torch.Tensor) -> tuple[Program, Program]:
        """The prefill and decode programs on `module`'s shards, compiled on first use."""
        if self.programs is None:
            step = CacheStep(self.model)
            example = _example_cache(self.model, ids)
            batch = 2 * self.mesh.size("depth") * self.mesh.size("row")  # a symbolic batch in every mode
            carried = {i: i for i in range(1, 1 + 2 * len(example))}  # each cache tensor, fed back in place
            programs = []
            for length in (2, 1):
                step_ids = torch.zeros(batch, length, dtype=ids.dtype, device=ids.device)
                compiled = compile_for(step, self.mesh, (step_ids, _example_past(example, batch)),
                                       dataclasses.replace(self.options, dynamic=True), self.cluster, training=False,
                                       carried=carried)
                programs.append(module.adopt(compiled.program))
            _check_same_cache(*programs)
            log.info("generation: prefill and decode programs compiled for mesh %s; the cache is laid out as %s",
                     self.mesh, next(s.layout for s in programs[0].slots if s.role == "local input"))
            self.programs = tuple(programs)
        return self.programs


def _check_same_cache(prefill: Program, decode: Program) -> None:
    """ValueError unless both programs take and give the cache in the same layouts."""
    theirs = {s.name: s.layout for s in decode.slots if s.role == "local input"}
    for slot in prefill.slots:
        if slot.role == "local input" and slot.layout != theirs[slot.name]:
            raise ValueError(f"cache tensor {slot.name} is laid out as {slot.layout} by the prefill program but "
                             f"{theirs[slot.name]} by the decode program on mesh {prefill.mesh}, so one cannot feed "
                             "the other: generate with the unsharded model, and report the model")


def _check_positions(prefill: Program, batch: int, length: int, new: int) -> None:
    """ValueError, before any token is generated, if a prompt of `length` tokens and `new` generated
    ones look up past a position table: the last call sees `length + new - 1` positions, as a prefill
    of them all on an empty cache would."""
    if new < 2:
        return
    ids = torch.empty(batch, length + new - 1, dtype=torch.long, device="meta")
    try:
        prefill.call_output_shapes([ids, *_empty_cache(prefill, batch, device="meta")])
    except ValueError as err:
        raise ValueError(f"generate: {batch} prompts of {length} tokens and max_new_tokens={new} (the last step "
                         f"sees {length + new - 1} positions): {err}") from None


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _example_cache(model: nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One cached token of one sequence from the unsharded model: each layer's keys and values, for
    their heads, head dim and dtype."""
    with torch.no_grad():
        out = model(input_ids=ids[:1, :1], use_cache=True)
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    return [(layer.keys, layer.values) for layer in cache.layers]


def _example_past(example, batch: int, cached: int = 2) -> tuple:
    """Cache tensors of `batch` sequences and `cached` tokens, shaped as the model's."""
    def grown(x):
        shape = list(x.shape)
        shape[0], shape[_CACHED_DIM] = batch, cached
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    return tuple((grown(k), grown(v)) for k, v in example)


def _empty_cache(program: Program, batch: int, device=None) -> list[torch.Tensor]:
    """A rank's blocks of an empty cache: each carried input's layout at `batch` sequences, 0 tokens."""
    blocks = []
    for slot in program.slots:
        if slot.role == "local input":
            shape = list(slot.shape)
            shape[0], shape[_CACHED_DIM] = batch, 0
            blocks.append(torch.zeros(slot.layout.local_shape(shape, program.mesh), dtype=slot.dtype, device=device))
    return blocks


def _step(module, program: Program, step_ids: torch.Tensor, blocks: dict[int, list]) -> tuple[torch.Tensor, dict]:
    """One program call on every rank `module` runs: the last position's logits (global) and each
    rank's new cache blocks."""
    rank_flats = {r: [step_ids, *blocks[r]] for r in blocks}
    shapes = program.call_output_shapes(next(iter(rank_flats.values())))  # the check of the sizes, first
    outputs = module.run_program(program, rank_flats)
    logits = module.global_output(program, 0, {r: out[0] for r, out in outputs.items()}, shapes[0])
    return logits, {r: list(out[1:]) for r, out in outputs.items()}  # outputs: the logits, then the cache
