"""The peak memory of one decode step per rank: predicted against tracked.

A small GPT-2 (transformers' `GPT2LMHeadModel`: 2 layers, n_embd 64, 4 heads, vocabulary 256,
128 positions, float32) is sharded with `tess_compile.shard(..., dynamic=True)` over 4 gloo
processes, at [2,2,1] (2.5-D) and 1-D p = 4. Each rank generates one token from a batch of
prompts (which compiles the prefill and decode programs, `sharded.generation.programs`), runs
the prefill of those prompts, then tracks one decode step, one new token per sequence after the
cached prompt, under torch's `MemTracker` (`torch.distributed._tools.mem_tracker`): the
generation loop's own call (`generation.generate._step`: the program on this rank's inputs and
cache blocks, then the logits gathered). The parameters, the step's inputs and the cache blocks
are tracked from before the step; the peak is the most bytes of tensors alive at once, the cache
going in and the cache coming out among them.

The prediction is `predict_memory(at_shapes(decode, shapes), MODULE_LOSS).total`
(`analysis.decode_plan`; the decode step alone, no training tail): the same decode program, its
inputs at the step's shapes (batch, cached length), on fake tensors under `MemTracker`. Each
mesh's row is its worst rank (the largest tracked peak).

    python3 benchmarks/decode_memory.py [--batch 8] [--cached 32] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from benchmarks.peak_memory import tracked_peak
from tess_compile.analysis.decode_plan import at_shapes
from tess_compile.analysis.memory import predict_memory
from tess_compile.analysis.step_tail import MODULE_LOSS
from tess_compile.generation.generate import _empty_cache, _step
from tess_compile.runtime.launch import run_local

MIB = 2**20
VOCAB = 256
MESHES = {"2.5d": (2, 1), "1d": (2, 1)}  # mode: (q, d), 4 ranks each: [2,2,1] and p = 4
QUICK = {"batch": 4, "cached": 16}  # --quick: a smaller batch and cache (the compiles take the time)


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=1,
                        eos_token_id=None)
    return GPT2LMHeadModel(config).eval()


def _after_prefill(sharded, prefill, prompt: torch.Tensor):
    """The decode step's inputs after the prefill of `prompt` (its next tokens, the mask and positions one
    longer), this rank's cache blocks, and the cache's global shapes."""
    batch, length = prompt.shape
    inputs = [prompt, torch.ones(batch, length, dtype=torch.long), torch.arange(length).expand(batch, length)]
    empty = {r: _empty_cache(prefill, batch) for r in sharded.rank_modules()}
    cache_shapes = prefill.call_output_shapes([*inputs, *next(iter(empty.values()))])[1:]
    logits, blocks = _step(sharded, prefill, inputs, empty)
    step = [logits.argmax(-1)[:, None], torch.ones(batch, length + 1, dtype=torch.long),
            torch.full((batch, 1), length)]
    return step, blocks, cache_shapes


def decode_peaks(rank: int, world: int, batch: int, cached: int, modes: list) -> list[dict]:
    """This rank's tracked and predicted peak of one decode step after `cached` prompt tokens, per mode."""
    torch.set_num_threads(1)
    prompt = torch.randint(0, VOCAB, (batch, cached), generator=torch.Generator().manual_seed(1))
    rows = []
    for mode in modes:
        q, d = MESHES[mode]
        sharded = tess_compile.shard(gpt2(), q, d, example_inputs={"input_ids": prompt}, mode=mode, dynamic=True,
                                     timeout=300)
        sharded.generate(prompt, max_new_tokens=1)  # compiles the prefill and decode programs
        (split, (prefill, decode)), = sharded.generation.programs.items()
        with torch.no_grad():
            inputs, blocks, cache_shapes = _after_prefill(sharded, prefill, prompt)
            tracked = tracked_peak(functools.partial(_step, sharded, decode, inputs, blocks), sharded, *inputs,
                                   *blocks[rank], calls=1)
        predicted = predict_memory(at_shapes(decode, [x.shape for x in inputs] + cache_shapes), MODULE_LOSS).total
        rows.append({"mode": mode, "mesh": str(sharded.mesh), "split": split, "tracked": tracked,
                     "predicted": predicted})
    return rows


def measure(batch: int, cached: int) -> list[dict]:
    """Each mesh's worst rank (the largest tracked peak), over one launch of 4 processes."""
    per_rank = run_local(decode_peaks, 4, args=(batch, cached, list(MESHES)), timeout_s=900, collective_timeout_s=600)
    return [max((ranks[k] for ranks in per_rank), key=lambda r: r["tracked"]) for k in range(len(MESHES))]


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':<5} {'mesh':<24} {'split':<6} {'tracked MiB':>11} {'predicted MiB':>13} {'error':>7}")
    for r in rows:
        print(f"{r['mode']:<5} {r['mesh']:<24} {r['split']:<6} {r['tracked'] / MIB:11.3f} "
              f"{r['predicted'] / MIB:13.3f} {100 * (r['predicted'] / r['tracked'] - 1):6.1f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cached", type=int, default=32, help="prompt tokens in the cache before the step")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    args = parser.parse_args(argv)
    batch, cached = (QUICK["batch"], QUICK["cached"]) if args.quick else (args.batch, args.cached)
    print(f"GPT-2 (2 layers, n_embd 64, 4 heads, vocab {VOCAB}), float32, batch {batch}, {cached} cached tokens; "
          "one decode step, the worst rank of each mesh")
    print_table(measure(batch, cached))
    return 0


if __name__ == "__main__":
    sys.exit(main())
