"""Greedy generation: time to first token, decode tokens/s and bytes moved per token, sharded against
unsharded and DTensor TP, for batches of 1 and 8 prompts.

One transformers Llama (float32, kv heads = heads so that every plan splits
them), the same prompts for every row, greedy decoding of `FULL["new"]` tokens
(`QUICK`'s with --quick) after a prefill. Rows, each over local gloo processes
on this machine (one thread each; one launch per row and batch):

- unsharded: the model's own `generate`, this process;
- tess 2.5d [q, q, d]: `shard(..., dynamic=True).generate`, the batch split of
  the decode left to tess ("auto": the cost model picks SUMMA's or the
  weight-stationary one; a batch of one decodes programs of one sequence);
- tess 2.5d [q, q, d] with `batch_split="depth"`: the serving layout, each
  weight laid out for the weight-stationary decode (skipped at a batch of one,
  or one that d does not divide: "auto" decodes it in programs of one sequence);
- tess 1d (p = q*q*d);
- DTensor TP: torch's `parallelize_module` with the Megatron plan (q, k, v, gate,
  up column-wise, o and down row-wise; embedding and head whole) over p ranks,
  then the model's own `generate` (its cache holds each rank's heads).

Each row first generates from the same batch (compiling the programs of that
batch), then a timed generate with a streamer that clocks every token (rank
0's clock): first token ms is the call's start to its first token (the
prefill step); decode tokens/s counts the tokens after the first, of the
whole batch, over their wall time. Bytes per token: the payload rank 0 hands
its collectives during the timed call over the tokens it generates (tess:
the runtime's `comm.records`; DTensor: the functional collectives dispatched
during the call). The decode split is the key of tess's
`generation.programs`. Every row checks its tokens against the unsharded
model's.

    python benchmarks/generate.py            # [2, 2, 2] and p = 8, batches 1 and 8
    python benchmarks/generate.py --quick    # smaller, for a smoke run
    python benchmarks/generate.py --batches 4 -q 2 -d 1 --out benchmarks/results/generate.json
    python benchmarks/generate.py --batches 4 --hidden 256 --layers 2   # the decode split auto picks, timed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import tess_compile

__all__ = ["Row", "main", "make_model", "make_prompt", "markdown", "measure", "rows_for"]

QUICK = {"hidden": 64, "layers": 2, "heads": 8, "vocab": 256, "prompt": 8, "new": 4}
FULL = {**QUICK, "hidden": 512, "layers": 4, "vocab": 8192, "prompt": 32, "new": 32}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a table: how its model is run (`kind` "tess" or "dtensor"; tess's `mode` and `batch_split`)."""

    name: str
    kind: str
    mode: str = "2.5d"
    batch_split: str = "auto"


def make_model(sizes: dict):
    """The benchmark's Llama, in eval mode, the same weights on every rank (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=sizes["hidden"], intermediate_size=2 * sizes["hidden"],
                         num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
                         num_key_value_heads=sizes["heads"], vocab_size=sizes["vocab"],
                         max_position_embeddings=sizes["prompt"] + sizes["new"] + 8, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def make_prompt(sizes: dict, batch: int) -> torch.Tensor:
    """`batch` prompts of random tokens, the same on every rank."""
    return torch.randint(0, sizes["vocab"], (batch, sizes["prompt"]), generator=torch.Generator().manual_seed(0))


class _Clock:
    """A streamer (transformers' `put`/`end`) that notes the time of each `put`: the prompt's, then each token's."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class _CommBytes(TorchDispatchMode):
    """Sums the bytes of the input tensor of each functional collective dispatched under it (DTensor's)."""

    def __init__(self):
        super().__init__()
        self.num_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and not func.__name__.startswith("wait_tensor"):
            first = next(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
            self.num_bytes += first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))


def _dtensor_tp(model, p: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (p,))
    plan = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _timed(generate, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, dict]:
    """A warm-up generate (it compiles what the batch needs), then a timed one: its tokens, the first
    token's ms and the decode tokens/s."""
    generate(prompt, max_new_tokens=2, do_sample=False)
    clock = _Clock()
    start = time.perf_counter()
    out = generate(prompt, max_new_tokens=new, do_sample=False, streamer=clock)
    first, last = clock.times[1], clock.times[-1]  # times[0]: the prompt's put
    decoded = (new - 1) * prompt.shape[0]
    return out, {"first token ms": (first - start) * 1e3, "decode tokens/s": decoded / (last - first)}


def _run_tess(model, prompt: torch.Tensor, new: int, row: Row, q: int, d: int) -> tuple[torch.Tensor, dict]:
    """`row`'s module at [q, q, d] (`shard`, with the row's mode and batch split): its tokens and measures."""
    sharded = tess_compile.shard(model, q, d, example_inputs={"input_ids": prompt}, mode=row.mode,
                                 batch_split=row.batch_split, dynamic=True, timeout=300)

    def generate(*args, **kwargs):
        sharded.comm.records.clear()  # each call's own: after the timed call, its records
        return sharded.generate(*args, **kwargs)

    out, measured = _timed(generate, prompt, new)
    moved = sum(record.num_bytes for record in sharded.comm.records)
    split = ", ".join(sharded.generation.programs)  # a fresh module: the programs of this batch only
    return out, {**measured, "bytes/token": moved / (new * prompt.shape[0]), "split": split}


def _run_dtensor(model, prompt: torch.Tensor, new: int, p: int) -> tuple[torch.Tensor, dict]:
    """The Megatron plan over p ranks, the model's own `generate`: its tokens and measures."""
    tp = _dtensor_tp(model, p)
    counter = _CommBytes()

    def generate(*args, **kwargs):
        counter.num_bytes = 0
        with counter:
            return tp.generate(*args, **kwargs)

    out, measured = _timed(generate, prompt, new)
    return out, {**measured, "bytes/token": counter.num_bytes / (new * prompt.shape[0]), "split": "-"}


def _worker(rank: int, world_size: int, row: Row, sizes: dict, batch: int, q: int, d: int,
            expected: torch.Tensor) -> dict:
    """One row at one batch, on this rank: the measures and whether the tokens are `expected`."""
    torch.set_num_threads(1)
    model, prompt, new = make_model(sizes), make_prompt(sizes, batch), sizes["new"]
    if row.kind == "dtensor":
        out, measured = _run_dtensor(model, prompt, new, world_size)
    else:
        out, measured = _run_tess(model, prompt, new, row, q, d)
    return {**measured, "same tokens": torch.equal(out, expected)}


def _unsharded(sizes: dict, batch: int) -> tuple[dict, torch.Tensor]:
    """The unsharded model's row at `batch`, in this process, and its tokens."""
    torch.set_num_threads(1)
    model, prompt = make_model(sizes), make_prompt(sizes, batch)
    out, measured = _timed(model.generate, prompt, sizes["new"])
    return {**measured, "bytes/token": 0.0, "split": "-", "same tokens": True}, out


def rows_for(q: int, d: int) -> list[Row]:
    """The sharded rows of a [q, q, d] mesh and p = q*q*d."""
    p = q * q * d
    return [Row(f"tess 2.5d [{q},{q},{d}]", "tess"),
            Row(f'tess 2.5d [{q},{q},{d}] batch_split="depth"', "tess", batch_split="depth"),
            Row(f"tess 1d p={p}", "tess", mode="1d"),
            Row(f"DTensor TP p={p}", "dtensor")]


def measure(sizes: dict, batch: int, q: int, d: int) -> tuple[dict, list[str]]:
    """Every row at `batch`: {name: measures}, and notes on the rows skipped."""
    unsharded, expected = _unsharded(sizes, batch)
    table, notes = {"unsharded": unsharded}, []
    for row in rows_for(q, d):
        if row.batch_split == "depth" and (batch == 1 or batch % d):
            notes.append(f'{row.name}: skipped at batch {batch} (a batch of one, or one d={d} does not divide); '
                         'batch_split="auto" decodes one sequence weight-stationary')
            continue
        table[row.name] = tess_compile.run_local(_worker, q * q * d, args=(row, sizes, batch, q, d, expected),
                                                 timeout_s=900)[0]
    return table, notes


def markdown(table: dict) -> str:
    """`table` ({name: measures}) as a markdown table."""
    lines = ["| | decode split | first token ms | decode tokens/s | bytes/token/rank | same tokens |",
             "|---|---|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['split']} | {row['first token ms']:.1f} | {row['decode tokens/s']:.1f} | "
                     f"{row['bytes/token']:,.0f} | {row['same tokens']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few tokens (a smoke run)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes, one table each")
    parser.add_argument("-q", type=int, default=2)
    parser.add_argument("-d", type=int, default=2)
    parser.add_argument("--hidden", type=int, help="the model's hidden size (default: the size's own)")
    parser.add_argument("--layers", type=int, help="its layers (default: the size's own)")
    parser.add_argument("--out", help="also write the results as JSON here (e.g. benchmarks/results/generate.json)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    sizes = {**sizes, **{key: getattr(args, key) for key in ("hidden", "layers") if getattr(args, key)}}
    print(f"greedy generation, Llama hidden {sizes['hidden']}, {sizes['layers']} layers, vocab {sizes['vocab']}, "
          f"prompt {sizes['prompt']}, {sizes['new']} new tokens, float32, gloo, 1 thread per rank")
    record = {"sizes": sizes, "q": args.q, "d": args.d, "batches": {}}
    for batch in [int(b) for b in args.batches.split(",")]:
        table, notes = measure(sizes, batch, args.q, args.d)
        record["batches"][batch] = {"rows": table, "notes": notes}
        print(f"\nbatch {batch}\n\n{markdown(table)}")
        for note in notes:
            print(f"\n{note}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
