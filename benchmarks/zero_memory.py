"""Parameter, gradient and AdamW bytes per rank: data parallel 2 x [2,2,1] with and without ZeRO.

Eight local gloo processes on the mesh `(dp, depth, row, col) = (2, 1, 2, 2)`
train a small GPT-like model (token embedding tied to the output head, L
blocks of fused-QKV causal attention and a GELU MLP 4x, float32) for one
AdamW step through `tess_compile.shard(..., mesh=root)`, then through
`shard(..., mesh=root, zero=True)` (FSDP2 over dp). After the step's backward
each rank counts the bytes of its parameters, gradients and AdamW state
(`exp_avg`, `exp_avg_sq`) by their local tensors. The unsharded model's
bytes and the ideal (unsharded / 8 ranks) stand beside them.

Between steps ZeRO keeps 1/dp of each; the whole module is one FSDP unit,
so from forward to the end of backward a rank also holds its whole
tensor-parallel parameters (all-gathered over dp), as without ZeRO.

    python3 benchmarks/zero_memory.py [--layers 2] [--hidden 128] [--heads 4] [--vocab 512] [--seq 16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile  # noqa: E402
from tess_compile.runtime.launch import run_local

DP, Q, D = 2, 2, 1


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(x).split(h, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _bytes(module, opt) -> tuple[int, int, int]:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(module.parameters())
    return (
        sum(local(p).numel() * local(p).element_size() for p in params),
        sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None),
        sum(local(v).numel() * local(v).element_size()
            for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
    )


def _worker(rank, world_size, args):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    root = init_device_mesh("cpu", (DP, D, Q, Q), mesh_dim_names=("dp", "depth", "row", "col"))
    group = root.get_local_rank("dp")
    rows = 2 * D * Q
    out = {}
    for zero in (False, True):
        torch.manual_seed(0)
        model = TinyLM(args.vocab, args.hidden, args.heads, args.layers)
        ids = torch.randint(0, args.vocab, (DP * rows, args.seq))[group * rows:(group + 1) * rows]
        sharded = tess_compile.shard(model, Q, D, example_inputs=(ids,), mesh=root, zero=zero, timeout=300)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
        logits = tess_compile.full_tensor(sharded(ids))
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        opt.step()
        out["zero" if zero else "mesh"] = _bytes(sharded, opt)
    if rank == 0:
        n = sum(p.numel() * p.element_size() for p in model.parameters())
        out["unsharded"] = (n, n, 2 * n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()
    results = run_local(_worker, DP * Q * Q * D, args=(args,), timeout_s=900, collective_timeout_s=600)
    unsharded = results[0]["unsharded"]
    world = DP * Q * Q * D
    print(f"TinyLM: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, float32; "
          f"data parallel {DP} x [q={Q}, q={Q}, d={D}] = {world} gloo ranks; bytes per rank after one AdamW step")
    print(f"| {'':<32} | {'parameters':>10} | {'gradients':>10} | {'AdamW':>10} | {'total':>10} |")
    print(f"|{'-' * 34}|{'-' * 12}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
    rows = [("unsharded model", unsharded), ("ideal: unsharded / 8", tuple(b // world for b in unsharded))]
    for key, label in (("mesh", "mesh= (tensor parallel, dp avg)"), ("zero", "mesh=, zero=True (FSDP2)")):
        values = {r[key] for r in results}
        assert len(values) == 1, f"ranks differ: {values}"
        rows.append((label, values.pop()))
    for label, (params, grads, adamw) in rows:
        print(f"| {label:<32} | {params:>10,} | {grads:>10,} | {adamw:>10,} | {params + grads + adamw:>10,} |")


if __name__ == "__main__":
    main()
