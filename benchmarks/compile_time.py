"""Compile time of tess-compile's own passes against capture (torch.export).

A GPT of 36 pre-LN blocks (hidden 1280, 20 heads, MLP 4x) built on the meta
device, so no weight is ever allocated, compiled for several meshes. Prints
one table row per mesh: seconds in capture, place, rewrite, and the node
counts before and after the rewrite.

    python3 benchmarks/compile_time.py [--layers 36] [--hidden 1280] [--heads 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.paper_tables import Block  # noqa: E402
from tess_compile.passes.capture import capture
from tess_compile.passes.place import place
from tess_compile.passes.rewrite import rewrite
from tess_compile.core.mesh import Mesh

MESHES = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1)]


def measure(layers: int, hidden: int, heads: int, q: int, d: int) -> dict[str, float]:
    with torch.device("meta"):
        model = nn.Sequential(*[Block(hidden, heads) for _ in range(layers)])
        x = torch.empty(4 * q * d, 128, hidden)
    mesh = Mesh(q, d)
    times = {}
    start = time.perf_counter()
    gm = capture(model, (x,))
    times["capture"] = time.perf_counter() - start
    nodes = len(gm.graph.nodes)
    start = time.perf_counter()
    place(gm, mesh)
    times["place"] = time.perf_counter() - start
    start = time.perf_counter()
    per_rank = rewrite(gm, mesh)
    times["rewrite"] = time.perf_counter() - start
    return {**times, "nodes": nodes, "per_rank_nodes": len(per_rank.graph.nodes)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--heads", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads (meta device); seconds")
    print(f"{'mesh':>14} {'capture':>8} {'place':>7} {'rewrite':>8} {'passes':>7} {'nodes':>7} {'per-rank':>9}")
    for q, d in MESHES:
        if args.hidden % q or args.heads % q:
            continue
        row = measure(args.layers, args.hidden, args.heads, q, d)
        passes = row["place"] + row["rewrite"]
        print(
            f"{str(Mesh(q, d)):>14} {row['capture']:8.2f} {row['place']:7.2f} {row['rewrite']:8.2f} "
            f"{passes:7.2f} {row['nodes']:7d} {row['per_rank_nodes']:9d}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
