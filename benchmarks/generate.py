"""Greedy generation: tokens/s and bytes moved per token, sharded against unsharded and DTensor TP.

One transformers Llama (float32, kv heads = heads so that every plan splits
them), one prompt batch, greedy decoding of `--new` tokens after a prefill.
Rows, each over local gloo processes on this machine (one thread each):

- unsharded: the model's own `generate`, one process;
- tess 2.5d [q, q, d] and tess 1d (p = q*q*d): `shard(..., dynamic=True).generate`,
  the KV cache sharded (batch over depth and row, heads over col);
- DTensor TP: torch's `parallelize_module` with the Megatron plan (q, k, v, gate,
  up column-wise, o and down row-wise; embedding and head whole) over p ranks,
  then the model's own `generate` (its cache holds each rank's heads).

tokens/s counts generated tokens of the whole batch over the generate call's
wall time (rank 0's; compiles happen before timing). Bytes per token: the
payload rank 0 hands its collectives during the call, over the tokens generated
(tess: the runtime's `comm.records`; DTensor: the functional collectives
dispatched during the call). Every sharded row checks its tokens against the unsharded model's.

    python benchmarks/generate.py            # [2, 2, 2] and p = 8
    python benchmarks/generate.py --quick    # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import tess_compile


def make_model(sizes: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=sizes["hidden"], intermediate_size=2 * sizes["hidden"],
                         num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
                         num_key_value_heads=sizes["heads"], vocab_size=sizes["vocab"],
                         max_position_embeddings=sizes["prompt"] + sizes["new"] + 8, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def make_prompt(sizes: dict) -> torch.Tensor:
    return torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["prompt"]), generator=torch.Generator().manual_seed(0))


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


def _timed(generate, prompt, new: int):
    start = time.perf_counter()
    out = generate(prompt, max_new_tokens=new, do_sample=False)
    return out, time.perf_counter() - start


def _worker(rank: int, world_size: int, name: str, sizes: dict, q: int, d: int) -> dict:
    torch.set_num_threads(1)
    model, prompt, new = make_model(sizes), make_prompt(sizes), sizes["new"]
    expected = model.generate(prompt, max_new_tokens=new, do_sample=False)
    if name == "DTensor TP":
        tp = _dtensor_tp(copy.deepcopy(model), world_size)
        tp.generate(prompt, max_new_tokens=2, do_sample=False)  # warm
        with _CommBytes() as counter:
            out, seconds = _timed(tp.generate, prompt, new)
        moved = counter.num_bytes
    else:
        mode = "1d" if name.startswith("tess 1d") else "2.5d"
        sharded = tess_compile.shard(copy.deepcopy(model), q, d, example_inputs={"input_ids": prompt}, mode=mode,
                                     dynamic=True, timeout=300)
        sharded.generate(prompt, max_new_tokens=2)  # compiles the prefill and decode programs
        sharded.comm.records.clear()
        out, seconds = _timed(sharded.generate, prompt, new)
        moved = sum(record.num_bytes for record in sharded.comm.records)
    tokens = new * prompt.shape[0]
    return {"tokens/s": tokens / seconds, "bytes/token": moved / tokens, "same tokens": torch.equal(out, expected)}


def _unsharded(sizes: dict) -> dict:
    torch.set_num_threads(1)
    model, prompt = make_model(sizes), make_prompt(sizes)
    model.generate(prompt, max_new_tokens=2, do_sample=False)
    _, seconds = _timed(model.generate, prompt, sizes["new"])
    return {"tokens/s": sizes["new"] * prompt.shape[0] / seconds, "bytes/token": 0.0, "same tokens": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few tokens (a smoke run)")
    parser.add_argument("-q", type=int, default=2)
    parser.add_argument("-d", type=int, default=2)
    args = parser.parse_args(argv)
    quick = {"hidden": 64, "layers": 2, "heads": 8, "vocab": 256, "batch": 8, "prompt": 8, "new": 4}
    sizes = quick if args.quick else {**quick, "hidden": 512, "layers": 4, "vocab": 8192, "prompt": 32, "new": 32}
    p = args.q * args.q * args.d
    rows = {"unsharded": _unsharded(sizes)}
    for name in (f"tess 2.5d [{args.q},{args.q},{args.d}]", f"tess 1d p={p}", f"DTensor TP p={p}"):
        kind = "DTensor TP" if name.startswith("DTensor") else name
        rows[name] = tess_compile.run_local(_worker, p, args=(kind, sizes, args.q, args.d), timeout_s=900)[0]
    print(f"greedy generation, Llama hidden {sizes['hidden']}, {sizes['layers']} layers, vocab {sizes['vocab']}, "
          f"batch {sizes['batch']}, prompt {sizes['prompt']}, {sizes['new']} new tokens, gloo, 1 thread per rank")
    print(f"{'':28} {'tokens/s':>10} {'bytes/token/rank':>18} {'same tokens':>12}")
    for name, row in rows.items():
        print(f"{name:28} {row['tokens/s']:10.1f} {row['bytes/token']:18,.0f} {row['same tokens']!s:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
