"""Generation on a compiled causal LM's shards, as transformers' `generate` samples or decodes greedily,
its KV cache sharded and never gathered.

Two programs of `CacheStep` (the model's forward on the new tokens, their
attention mask and position ids, and a cache given as tensors), both
`dynamic=True` in the batch, the new tokens, the mask's length and the
cached length:

- prefill: two or more new tokens after a cache of any length (0 too);
- decode: one new token. transformers' attention takes another path for one
  query (no causal mask), so the length of the new tokens is fixed there.

A single prompt of `LONG_PROMPT` tokens or more is prefilled by a third,
static program of its length (one per length, compiled on first use), whose
tokens split over the mesh as a training step's do (`token_split`, the
module's option: context-parallel attention, sequence parallelism in 1-D), so
the prompt's activations and work spread over every rank. Its cache comes out
split by tokens and is laid out once as the decode program takes it (gathered
along the token axes, one collective per cache tensor). Where the mesh cannot
split the prompt's tokens (`token_split="none"`, a length the token axes do
not take), the dynamic prefill serves, as for shorter prompts.

Each is compiled once (`compile_for`, with the module's options and cluster),
on the first `generate`, in eval mode, on the very shards of the module
`shard` or `simulate` returned (their parameters must be laid out alike:
checked). The cache is carried from step to step as each
rank's block (`compile_model(..., carried=...)`): batch over depth and row,
heads over col, as the attention lays out its keys and values; only the
last position's logits are gathered. On them, every rank runs transformers'
own logits processors, stopping criteria and sampling (`prepare`); over
processes, the tokens of tensor-parallel rank 0 are broadcast, so ranks never
diverge. No program is compiled per token.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from tess_compile.analysis.compile_entry import compile_for
from tess_compile.analysis.cost_model import predict_time
from tess_compile.analysis.rank_timing import step_seconds, world_max
from tess_compile.core.cluster import Cluster
from tess_compile.core.layout import local_block
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import AUTO, CompileOptions
from tess_compile.core.program import Program
from tess_compile.generation.cache_step import CacheStep
from tess_compile.generation.prepare import Call, prepare_call
from tess_compile.core.row_split import resolve_batch_split, splits_of
from tess_compile.runtime.sharded_module import ShardedModule

__all__ = ["LONG_PROMPT", "Generation"]

log = logging.getLogger("tess_compile")

_CACHED_DIM = 2  # [batch, kv heads, cached, head dim]
_STEP_INPUTS = 3  # the new tokens, the attention mask, the position ids; then the cache
LONG_PROMPT = 512  # tokens of a single prompt from which its prefill splits them over the mesh
_DECODE_TIMINGS = 3  # timed decode steps of each candidate batch split over processes (after one untimed)


class Generation:
    """`generate` for a module compiled from `model` (a transformers causal LM) with `dynamic=True`."""

    def __init__(self, model: nn.Module, mesh: Mesh, options: CompileOptions, cluster: Cluster):
        self.model, self.mesh, self.options, self.cluster = model, mesh, options, cluster
        self.programs: dict[str, tuple[Program, Program]] = {}  # batch split -> prefill and decode, on the shards
        self._decoders: dict[str, Program] = {}  # batch split -> a decode program compiled to be priced
        self._choices: dict[tuple[str, ...], str] = {}  # candidate splits -> the one priced fastest
        self._long_prefills: dict[int, Program | None] = {}  # prompt length -> its token-split prefill, or None

    def generate(self, module, inputs: torch.Tensor | None = None, generation_config=None, logits_processor=None,
                 stopping_criteria=None, prefix_allowed_tokens_fn=None, streamer=None, **kwargs):
        """`model.generate(...)` on `module`'s shards: greedy or sampled, with transformers' logits processors
        and stopping criteria; returns the sequences, or a `GenerateDecoderOnlyOutput` with
        `return_dict_in_generate=True` (`scores` and `logits` per step)."""
        call = prepare_call(self.model, self.mesh, inputs, generation_config, kwargs, logits_processor,
                            stopping_criteria, prefix_allowed_tokens_fn)
        _check_positions(module, call)
        programs = self._compiled(module, call.input_ids)
        long_prefill = self._long_prefill(module, call.input_ids)
        if streamer is not None:
            streamer.put(call.input_ids.cpu())
        with torch.no_grad():
            ids, scores, logits = self._decode(module, programs, call, streamer, long_prefill)
        if streamer is not None:
            streamer.end()
        if not call.config.return_dict_in_generate:
            return ids
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=ids, scores=scores, logits=logits)

    def _decode(self, module, programs: tuple[Program, Program], call: Call, streamer,
                long_prefill: Program | None = None):
        """transformers' `_sample` loop, each forward a program call (the first by `long_prefill` where
        there is one): the sequences, and the scores and logits of each step where the config asks for
        them (else None)."""
        config, ids = call.config, call.input_ids
        recorded = config.return_dict_in_generate
        scores = () if recorded and config.output_scores else None
        raw_logits = () if recorded and config.output_logits else None
        state = {"attention_mask": call.attention_mask, "position_ids": call.position_ids}
        blocks = {r: _empty_cache(programs[0], ids.shape[0]) for r in module.rank_modules()}
        unfinished = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
        step_ids = ids
        while True:
            program = programs[0] if step_ids.shape[1] > 1 else programs[1]
            positions = state["position_ids"][:, -step_ids.shape[1]:]
            step_inputs = [step_ids, state["attention_mask"], positions]
            if long_prefill is not None:
                logits, blocks = _split_step(module, long_prefill, step_inputs, programs[1])
                long_prefill = None
            else:
                logits, blocks = _step(module, program, step_inputs, blocks)
            state = self.model._update_model_kwargs_for_generation({}, state)  # the mask and positions, one longer
            step_scores = call.processors(ids, logits.to(copy=True, dtype=torch.float32, device=ids.device))
            scores = scores + (step_scores,) if scores is not None else None
            raw_logits = raw_logits + (logits,) if raw_logits is not None else None
            tokens = _choose(call, step_scores, unfinished)
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            unfinished = unfinished & ~call.criteria(ids, scores)
            tokens, unfinished = _agree(module, tokens, unfinished)
            ids[:, -1] = tokens
            if streamer is not None:
                streamer.put(tokens.cpu())
            if unfinished.max() == 0:
                return ids, scores, raw_logits
            step_ids = tokens[:, None]

    def _compiled(self, module, ids: torch.Tensor) -> tuple[Program, Program]:
        """The prefill and decode programs for a batch of `ids.shape[0]` prompts on `module`'s shards, in the
        batch split `_split` picks; compiled on first use, on the shards' own layouts (`state_layouts`)."""
        batch = ids.shape[0]
        split = self._split(module, ids, batch)
        if split not in self.programs:
            prefill = self._program(module, ids, split, new=2)
            decode = self._decoders.get(split) or self._program(module, ids, split, new=1)
            _check_same_cache(prefill, decode)
            log.info("generation: prefill and decode programs compiled for mesh %s, batch split %s; the cache is "
                     "laid out as %s", self.mesh, split, next(s.layout for s in prefill.slots if s.role == "local input"))
            self.programs[split] = (prefill, decode)
        return self.programs[split]

    def _long_prefill(self, module, ids: torch.Tensor) -> Program | None:
        """The token-split prefill of a single prompt of `LONG_PROMPT` tokens or more (module docstring),
        compiled on first use for its length; None for other prompts and where its tokens stay whole."""
        batch, length = ids.shape
        if batch != 1 or length < LONG_PROMPT or self.options.token_split == "none":
            return None
        if length not in self._long_prefills:
            self._long_prefills[length] = self._compile_long_prefill(module, ids)
        return self._long_prefills[length]

    def _compile_long_prefill(self, module, ids: torch.Tensor) -> Program | None:
        """`CacheStep` on one prompt of `ids`' length and an empty cache, static, in the module's options
        (its token split), adopted on `module`'s shards; None (said) where its tokens stay whole."""
        length = ids.shape[1]
        step_inputs = (torch.zeros_like(ids), torch.ones_like(ids), torch.arange(length, device=ids.device)[None])
        options = dataclasses.replace(self.options, dynamic=False, batch_split="none")
        try:
            compiled = compile_for(CacheStep(self.model), self.mesh, (*step_inputs, ()), options, self.cluster,
                                   training=False, state_layouts=module.state_layouts())
        except ValueError as err:
            log.warning("generation: a prompt of %d tokens prefills whole on mesh %s: its token split does not "
                        "compile: %s", length, self.mesh, err)
            return None
        if compiled.program.rows.tokens == "none":
            log.info("generation: a prompt of %d tokens prefills whole on mesh %s (%s)", length, self.mesh,
                     compiled.program.rows)
            return None
        log.info("generation: a prompt of %d tokens prefills with %s on mesh %s", length, compiled.program.rows,
                 self.mesh)
        return module.adopt(compiled.program)

    def _split(self, module, ids: torch.Tensor, batch: int) -> str:
        """The batch split of `batch` prompts: "one" for a single prompt (a program of one sequence, which
        a symbolic batch does not serve: see `core.dynamic`), the options' own, or where both divide the
        batch, SUMMA's ("depth_row") or the weight-stationary one ("depth", else "none"), whichever's
        decode step is faster (`_fastest`), chosen once."""
        if batch == 1:
            return "one"
        if self.options.batch_split != AUTO:
            resolve_batch_split(self.options.batch_split, batch, self.mesh)  # ValueError if it does not divide
            return self.options.batch_split
        splits = splits_of(batch, self.mesh)  # SUMMA's first where it divides, then the weight-stationary ones
        candidates = tuple(splits[:2] if splits[0] == "depth_row" else splits[:1])
        if candidates not in self._choices:
            for split in candidates:
                self._decoders.setdefault(split, self._program(module, ids, split, new=1))
            self._choices[candidates] = self._fastest(module, ids, candidates)
        return self._choices[candidates]

    def _fastest(self, module, ids: torch.Tensor, splits: tuple[str, ...]) -> str:
        """The split of `splits` whose decode step is fastest: measured where `module` runs over processes
        (`_decode_seconds`, on `ids`' batch and a cache of their length), priced by the cost model on the
        module's cluster in one process (the simulator's lockstep runs every rank in turn, so its clock
        is not the mesh's)."""
        how, seconds = "priced", {s: predict_time(self._decoders[s], self.cluster).forward_s for s in splits}
        if isinstance(module, ShardedModule):
            how, seconds = "measured", {s: _decode_seconds(module, self._decoders[s], ids) for s in splits}
        chosen = min(seconds, key=seconds.get)
        log.info("generation: decode steps %s %s on mesh %s: batch split %s", how,
                 {k: f"{v * 1e3:.3g} ms" for k, v in seconds.items()}, self.mesh, chosen)
        return chosen

    def _program(self, module, ids: torch.Tensor, split: str, new: int) -> Program:
        """The step program of `new` tokens (2: prefill, any number of 2 or more; 1: decode) in batch split
        `split`, compiled symbolic in batch (a multiple of the ranks that split it; "one": a batch of one),
        the new tokens, the mask and the cache, and adopted on `module`'s shards."""
        example = _example_cache(self.model, ids)
        batch = 1 if split == "one" else 2 * self.mesh.size("depth") * self.mesh.size("row")
        # each cache tensor (output i, after the logits) fed back in place (input i + 2, after the step's inputs)
        carried = {i: i + _STEP_INPUTS - 1 for i in range(1, 1 + 2 * len(example))}
        step_inputs = (torch.zeros(batch, new, dtype=ids.dtype, device=ids.device),
                       torch.ones(batch, 2 + new, dtype=torch.long, device=ids.device),
                       torch.zeros(batch, new, dtype=torch.long, device=ids.device))
        options = dataclasses.replace(self.options, dynamic=True, batch_split="none" if split == "one" else split)
        compiled = compile_for(CacheStep(self.model), self.mesh, (*step_inputs, _example_past(example, batch)),
                               options, self.cluster, training=False, carried=carried,
                               state_layouts=module.state_layouts())
        return module.adopt(compiled.program)


def _choose(call: Call, scores: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
    """The next token of each sequence as transformers' `_sample` picks it: sampled from the softmax
    of the processed scores (on the default generator) or their argmax; the pad token once a
    sequence has finished, where a stopping criterion watches for an end token."""
    if call.config.do_sample:
        tokens = torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        tokens = torch.argmax(scores, dim=-1)
    if any(hasattr(criterion, "eos_token_id") for criterion in call.criteria):
        pad = call.config._pad_token_tensor.to(tokens.device)
        tokens = tokens * unfinished + pad * (1 - unfinished)
    return tokens


def _agree(module, tokens: torch.Tensor, unfinished: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and unfinished flags of tensor-parallel rank 0 on every rank of a module over processes
    (where ranks seeded alike chose the same already), so that no rank can diverge; in one process, as
    they are (all ranks share one choice)."""
    if not isinstance(module, ShardedModule):
        return tokens, unfinished
    both = torch.stack([tokens, unfinished]).to(module.device)
    dist.broadcast(both, src=module.world.members[0], group=module.world.group)
    both = both.to(tokens.device)
    return both[0], both[1]


def _check_same_cache(prefill: Program, decode: Program) -> None:
    """ValueError unless both programs take and give the cache in the same layouts."""
    theirs = {s.name: s.layout for s in decode.slots if s.role == "local input"}
    for slot in prefill.slots:
        if slot.role == "local input" and slot.layout != theirs[slot.name]:
            raise ValueError(f"cache tensor {slot.name} is laid out as {slot.layout} by the prefill program but "
                             f"{theirs[slot.name]} by the decode program on mesh {prefill.mesh}, so one cannot feed "
                             "the other: generate with the unsharded model, and report the model")


def _check_positions(module, call: Call) -> None:
    """ValueError, before any token is generated, if the prompts and the new tokens would look up past a
    position table that the module's program looks up positions in (its `dynamic.limits`: GPT-2's learned
    positions): the last step feeds the position of the last prompt token plus `new - 1`."""
    dynamic = module.program.dynamic
    new = call.config.max_length - call.input_ids.shape[1]
    if dynamic is None or new < 2:
        return
    largest = int(call.position_ids[:, -1].max()) + new - 1
    for limit in dynamic.limits:
        if largest >= limit.rows:
            batch, length = call.input_ids.shape
            raise ValueError(f"generate: {batch} prompts of {length} tokens and max_new_tokens={new}: the last step "
                             f"looks up position {largest} in '{limit.table}', which has {limit.rows} rows, on mesh "
                             f"{module.mesh}: pass max_new_tokens <= {new - (largest - limit.rows + 1)}, or a model "
                             "with a longer table")


def _example_cache(model: nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One cached token of one sequence from the unsharded model: each layer's keys and values, for
    their heads, head dim and dtype."""
    with torch.no_grad():
        out = model(input_ids=ids[:1, :1], use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    return [(layer.keys, layer.values) for layer in cache.layers]


def _example_past(example, batch: int, cached: int = 2) -> tuple:
    """Cache tensors of `batch` sequences and `cached` tokens, shaped as the model's."""
    def grown(x):
        shape = list(x.shape)
        shape[0], shape[_CACHED_DIM] = batch, cached
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    return tuple((grown(k), grown(v)) for k, v in example)


def _empty_cache(program: Program, batch: int, device=None, cached: int = 0) -> list[torch.Tensor]:
    """A rank's blocks of a cache of zeros: each carried input's layout at `batch` sequences, `cached`
    tokens (by default none: an empty cache)."""
    blocks = []
    for slot in program.slots:
        if slot.role == "local input":
            shape = list(slot.shape)
            shape[0], shape[_CACHED_DIM] = batch, cached
            blocks.append(torch.zeros(slot.layout.local_shape(shape, program.mesh), dtype=slot.dtype, device=device))
    return blocks


def _decode_seconds(module: ShardedModule, program: Program, ids: torch.Tensor) -> float:
    """The median time of `_DECODE_TIMINGS` decode steps of `program` on `ids`' batch after a cache of
    their length (zeros: the time does not depend on the values), the slowest rank's, the same figure on
    every rank of the module's world, so that all of them pick the same split."""
    batch, length = ids.shape
    inputs = [torch.zeros(batch, 1, dtype=ids.dtype, device=ids.device),
              torch.ones(batch, length + 1, dtype=torch.long, device=ids.device),
              torch.full((batch, 1), length, dtype=torch.long, device=ids.device)]
    blocks = {r: _empty_cache(program, batch, module.device, cached=length) for r in module.rank_modules()}
    with torch.no_grad():
        seconds = step_seconds(lambda: _step(module, program, inputs, blocks), steps=_DECODE_TIMINGS, warmup=1,
                               device=module.device, group=module.world.group)
    return world_max(seconds, group=module.world.group)


def _split_step(module, program: Program, inputs: list[torch.Tensor], decode: Program) -> tuple[torch.Tensor, dict]:
    """The first step of one long prompt by its token-split prefill `program`: the last position's logits
    (global) and each rank's cache blocks, each cache tensor gathered from the token split once and laid
    out as `decode` takes it."""
    inputs = [x.contiguous() for x in inputs]
    outputs = module.run_program(program, {r: list(inputs) for r in module.rank_modules()})
    shapes = program.call_output_shapes(inputs)
    logits = module.global_output(program, 0, {r: out[0] for r, out in outputs.items()}, shapes[0])
    blocks: dict[int, list] = {r: [] for r in outputs}
    layouts = [slot.layout for slot in decode.slots if slot.role == "local input"]
    for index, layout in enumerate(layouts, 1):
        whole = module.global_output(program, index, {r: out[index] for r, out in outputs.items()}, shapes[index])
        for r in blocks:
            blocks[r].append(local_block(whole, layout, decode.mesh, r).contiguous())
    return logits, blocks


def _step(module, program: Program, inputs: list[torch.Tensor], blocks: dict[int, list]) -> tuple[torch.Tensor, dict]:
    """One program call on every rank `module` runs, on the step's global inputs and each rank's cache
    blocks: the last position's logits (global) and each rank's new cache blocks. Inputs are made
    contiguous, as transformers passes them: a strided one would get inductor code of its own shapes."""
    inputs = [x.contiguous() for x in inputs]
    rank_flats = {r: [*inputs, *blocks[r]] for r in blocks}
    shapes = program.call_output_shapes(next(iter(rank_flats.values())))  # the check of the sizes, first
    outputs = module.run_program(program, rank_flats)
    logits = module.global_output(program, 0, {r: out[0] for r, out in outputs.items()}, shapes[0])
    return logits, {r: list(out[1:]) for r, out in outputs.items()}  # outputs: the logits, then the cache
