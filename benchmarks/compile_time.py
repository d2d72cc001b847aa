"""Compile time at real sizes: Llama 3 8B and 70B on the meta device, with and without block reuse.

Each row compiles one config (`benchmarks/llama_sizes.py`: the whole model, a batch of 16 x
4,096 tokens with labels, built on the meta device, so no weight is allocated) for one mesh,
once with block reuse (the default: four blocks placed and rewritten, the others copied;
docs/architecture.md) and once without (`reuse_blocks=False`), and prints the CPU seconds of
each stage (the machine is shared: CPU time, not wall time, is what a compile costs):
capture (torch.export), place (with shortening the graph to four blocks), rewrite (with merging
products and alike regions), expand (copying block 2), buckets (the gradient buckets), checks
(the verifier and the repeated-work report, on the short graph with reuse) and the total, with
the per-rank graph's nodes. The capture is the same both ways (torch.export of the whole model).

`--inductor-layers 2,4` adds inductor's compile (`compile=True`: AOTAutograd and the C++
backend) of rank 0's per-rank program of the config cut to that many layers, forward and
backward, on the CPU: inductor compiles every block, with block reuse or not (docs/compiled.md
says why), so its seconds grow by a layer's.

    python3 benchmarks/compile_time.py [--configs 8b,70b] [--meshes 2.5d:4,4,4 1d:8] [--inductor-layers 2,4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.llama_sizes import make  # noqa: E402
from tess_compile.passes.driver import compile_model  # noqa: E402
from tess_compile.passes.observers import add_pass_observer, remove_pass_observer  # noqa: E402
from tess_compile.core.mesh import Mesh  # noqa: E402

STAGES = {  # column -> the passes (`passes/driver.py`'s names) it sums
    "capture": ("capture",),
    "place": ("shorten blocks", "place", "verify placed", "recompute blocks"),
    "rewrite": ("rewrite", "merge products", "alike regions", "recompute selective"),
    "expand": ("expand blocks",),
    "buckets": ("bucket gradients",),
    "checks": ("verify rewritten", "report repeated work"),
}


def parse_mesh(text: str) -> Mesh:
    """`2.5d:4,4,4` (q, q, d) or `1d:8` (ranks) as a Mesh."""
    mode, _, sizes = text.partition(":")
    numbers = [int(n) for n in sizes.split(",")]
    return Mesh(1, numbers[0], "1d") if mode == "1d" else Mesh(numbers[0], numbers[2], mode)


def measure(size: str, mesh: Mesh, reuse: bool, layers: int | None = None, batch: int = 16, seq: int = 4096) -> dict:
    """CPU seconds of each stage of one compile (`STAGES`), their total and the per-rank graph's nodes."""
    model, inputs = make(size, layers=layers, batch=batch, seq=seq)
    seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
    last = [time.process_time()]

    def observe(result) -> None:
        now = time.process_time()
        stage = next((name for name, passes in STAGES.items() if result.name in passes), None)
        if stage is not None:
            seconds[stage] += now - last[0]
        last[0] = now

    add_pass_observer(observe)
    start = last[0] = time.process_time()
    try:
        program = compile_model(model, mesh, inputs, reuse_blocks=reuse)
    finally:
        remove_pass_observer(observe)
    return {**seconds, "total": time.process_time() - start, "nodes": len(program.graph.graph.nodes)}


def inductor_seconds(size: str, mesh: Mesh, layers: int, batch: int = 16, seq: int = 4096) -> float:
    """CPU seconds of inductor's compile of rank 0's program of `size` cut to `layers` layers, forward and
    backward (`compile=True`'s `CompiledRank`), on empty CPU tensors of the local shapes; in one thread,
    with empty caches, the C++ compiler's runs counted (`cpu_seconds`)."""
    import torch._inductor.utils

    from tess_compile.core.fake_run import placeholder_values
    from tess_compile.ops.collectives import Comm
    from tess_compile.runtime.inductor import CompiledRank

    model, inputs = make(size, layers=layers, batch=batch, seq=seq)
    program = compile_model(model, mesh, inputs)
    values = placeholder_values(program.graph, mesh)  # empty: nothing is touched while compiling
    # one thread and empty caches (a new cache directory, the in-memory ones cleared): all of inductor's work
    # in this process or the C++ compiler runs it waits for, none of it read from an earlier compile
    with torch._inductor.utils.fresh_cache(), torch._inductor.config.patch(compile_threads=1):
        start = cpu_seconds()
        CompiledRank(program, backward_comm=Comm).compiled_for(values)
        return cpu_seconds() - start


def cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (inductor's C++ compiler runs)."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8b,70b", help="Llama 3 configs of benchmarks/llama_sizes.py")
    parser.add_argument("--meshes", nargs="+", default=["2.5d:4,4,4", "1d:8"], help="meshes: 2.5d:q,q,d or 1d:p")
    parser.add_argument("--layers", type=int, default=None, help="cut each config to this many layers")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--inductor-layers", default="", help="e.g. 2,4: inductor's compile at these depths")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # the replicated key/value heads of 1-D meshes, said per block
    columns = [*STAGES, "total"]
    print(f"CPU seconds per compile (batch {args.batch} x {args.seq} with labels, meta device); reuse: block reuse")
    print(f"{'config':>7} {'mesh':>16} {'reuse':>5} " + " ".join(f"{c:>8}" for c in columns) + f" {'nodes':>7}")
    for size in args.configs.split(","):
        for text in args.meshes:
            mesh = parse_mesh(text)
            for reuse in (True, False):
                row = measure(size, mesh, reuse, args.layers, args.batch, args.seq)
                cells = " ".join(f"{row[c]:8.2f}" for c in columns)
                print(f"{size:>7} {str(mesh):>16} {'yes' if reuse else 'no':>5} {cells} {row['nodes']:7d}", flush=True)
    for layers in filter(None, args.inductor_layers.split(",")):
        for size in args.configs.split(","):
            mesh = parse_mesh(args.meshes[0])
            seconds = inductor_seconds(size, mesh, int(layers), args.batch, args.seq)
            print(f"inductor, {size} cut to {layers} layers, {mesh}, rank 0: {seconds:.1f} CPU s", flush=True)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
