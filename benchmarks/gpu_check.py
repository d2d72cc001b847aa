"""The CUDA path, run and measured on one GPU (skips cleanly without CUDA).

One launch runs every section in turn and writes what it found after each, so a
section that fails or runs out of time leaves the others' results:

- `exact`: `tess_compile.simulate` of the benchmark GPT stack
  (`benchmarks.memory.Stack`) and of Hugging Face GPT-2 (vocabulary 50257, split
  unevenly) at [2,2,2] and 1-D p=4 on CUDA in float64: the largest relative error
  (in norm) of the output and of every gradient against the unsharded model;
- `bf16`: the same under bf16 autocast: the sharded and the unsharded model's
  errors against the float64 model, with test_bf16's bound (sharded <= twice
  the unsharded error + 1e-3);
- `nccl1`: `shard` in a world of one under NCCL (q = d = 1): output, gradients
  and the weights after one AdamW step against the unsharded model;
- `gloo8`: 8 processes over gloo with CUDA tensors (the one GPU shared): each
  collective the runtime calls, on the world group, then `shard` at 2.5-D
  [2,2,2] in every SUMMA schedule and 1-D p=8: the same comparison, or the
  error that stopped it (each step is written to a file first, and a crashed
  rank's stack comes back);
- `compiled`: `simulate(compile=True)` (inductor's Triton kernels) against
  eager on the GPT stack in float64, [1,1,1] then [2,2,2]: parity, the first
  (compiling) step, and the simulated step eager and compiled; and under bf16
  autocast at [2,2,2] against the float64 model, with test_bf16's bound;
- `kernels`: every row of the Tesseract paper's Tables 1 and 2 (one
  checkpointed layer, `benchmarks.paper_tables`), in bf16: rank 0's per-rank
  program, its collectives replaced by buffers of their outputs' shapes, timed
  forward and backward with CUDA events; its products' FLOPs over that time as
  a fraction of the GPU's bf16 rate; the device's busy fraction (kernel time
  from `torch.profiler` over wall time); the kernels the cost model counts
  (`cost_model.profile_program`), to fit the compute constants to
  (`--report`); peak memory of the step and AdamW against `predict_memory`;
- `kernels_compiled`: a few of those rows eager, compiled (`CompiledRank`,
  the `compile=True` runtime) and compiled with inductor's CUDA graphs;
- `memory`: the same local step for the GPT stack in each mode and `recompute=`
  option: the peak of two training steps, the allocator's
  (`torch.cuda.max_memory_allocated`) and `MemTracker`'s (what dispatch sees),
  against `predict_memory`;
- `world1`: a world of one under NCCL: the unsharded model under
  `torch.compile` against `shard(model, 1, 1, compile=True)`, step times;
- `adamw`: AdamW's step over that model's parameters as plain tensors and as
  DTensors, default (foreach), for-loop and fused.

Sections that compile run in child processes with a time limit, each printing
its main thread's stack every `--watchdog` seconds (where a hang hangs);
`--budget` seconds after the start the compiled rows stop starting.

    python3 benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json] [--sections exact,bf16,...]
    python3 benchmarks/gpu_check.py --report benchmarks/results/gpu_check.json

`--report` (no GPU needed) prints the tables of a results file and fits a
model of one rank-program's time to its measured local forward and backward
times: per phase the larger of the device's work and the host's
(`local_seconds`); and the split fit, the device's terms to each row's kernel
time and the host's to host-bound rows' steps, checked table against table
(`fit_split`). `--quick --device cpu` runs tiny sizes on the CPU (the tests'
dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tess_compile
from benchmarks.memory import Stack
from benchmarks.paper_tables import SEQ, TABLE_1, TABLE_2, compile_layer
from tess_compile.analysis.cost_model import profile_program
from tess_compile.analysis.memory import predict_memory
from tess_compile.analysis.step_tail import MODULE_LOSS
from tess_compile.core.mesh import Mesh
from tess_compile.ops.collectives import Comm, output_like, use_comm
from tess_compile.passes.driver import compile_model
from tess_compile.runtime import state
from tess_compile.runtime.launch import run_local

SECTIONS = ("exact", "bf16", "nccl1", "kernels", "memory", "compiled", "gloo8", "kernels_compiled", "world1", "adamw")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_check.json")
MESHES = [("2.5d", 2, 2), ("1d", 2, 1)]  # [2,2,2] and 1-D p=4
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}  # dense bf16, SXM datasheets
SIZES = {"full": {"layers": 2, "hidden": 64, "heads": 8, "batch": 8, "seq": 16, "vocab": 50257},
         "quick": {"layers": 1, "hidden": 16, "heads": 8, "batch": 4, "seq": 8, "vocab": 101}}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 where both are 0)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


# ---- models -------------------------------------------------------------------------------------


def gpt_stack(size: dict):
    torch.manual_seed(0)
    model = Stack(size["layers"], size["hidden"], size["heads"])
    x = torch.randn(size["batch"], size["seq"], size["hidden"])
    return model, (x,), lambda out: out.square().mean()


def hf_gpt2(size: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=size["vocab"], n_positions=size["seq"], n_embd=size["hidden"], n_layer=size["layers"],
                     n_head=size["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]))

    def loss_of(out):  # the logits' cross-entropy in their dtype (HF's own loss computes in float32)
        logits = _unwrap(out.logits)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten().to(logits.device))

    return model, {"input_ids": ids, "use_cache": False}, loss_of


MODELS = {"gpt_stack": gpt_stack, "hf_gpt2": hf_gpt2}


def _to(inputs, device, dtype=None):
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device, dtype) if dtype is not None and t.is_floating_point() else t.to(device)
    return {k: move(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(move(t) for t in inputs)


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _unwrap(out):
    """A model output's loss-bearing value: HF outputs as they are, DTensors gathered by
    `tess_compile.full_tensor` (one all-gather through the c10d group: DTensor's own
    `full_tensor()` goes through functional collectives, which crash over gloo with CUDA tensors)."""
    return tess_compile.full_tensor(out)


# ---- exactness on CUDA ----------------------------------------------------------------------------


def exact(args) -> list[dict]:
    """float64 on the device: simulate against the unsharded model, output and every gradient."""
    rows = []
    for name, build in MODELS.items():
        for mode, q, d in MESHES:
            model, inputs, loss_of = build(args.size)
            model = model.double().to(args.device)
            inputs = _to(inputs, args.device, torch.float64)
            oracle = copy.deepcopy(model)
            sim = tess_compile.simulate(model, q, d, example_inputs=inputs, mode=mode)
            out, ref = _call(sim, inputs), _call(oracle, inputs)
            loss, ref_loss = loss_of(out), loss_of(ref)
            loss.backward()
            ref_loss.backward()
            grads = sim.full_grads()
            errors = {"loss": rel(loss, ref_loss)}
            errors.update({n: rel(grads[n], p.grad) for n, p in oracle.named_parameters() if p.grad is not None})
            worst = max(errors, key=errors.get)
            rows.append({"model": name, "mode": mode, "ranks": q * q * d, "worst": errors[worst], "worst_at": worst,
                         "tensors": len(errors), "device": str(loss.device)})
            print(f"exact {name} {mode} p={q * q * d}: worst {errors[worst]:.1e} ({worst})", flush=True)
    return rows


def bf16_errors(make_sharded, model, inputs, loss_of, device) -> dict:
    """One forward and backward under bf16 autocast of `make_sharded(model)` and of `model` (its
    float32 weights): each one's error against the float64 model, the loss and every gradient
    not ~0, and whether the sharded one keeps within test_bf16's bound (at most twice the
    unsharded error + 1e-3)."""
    truth_model = copy.deepcopy(model).double()
    truth = loss_of(_call(truth_model, _to(inputs, device, torch.float64)))
    truth.backward()
    unsharded = copy.deepcopy(model)
    sharded = make_sharded(model)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        sharded_loss, plain_loss = loss_of(_call(sharded, inputs)), loss_of(_call(unsharded, inputs))
    sharded_loss.backward()
    plain_loss.backward()
    grads = sharded.full_grads()
    errors = {"loss": (rel(sharded_loss, truth), rel(plain_loss, truth))}
    for (n, p), t in zip(unsharded.named_parameters(), truth_model.parameters()):
        if p.grad is not None and t.grad.norm() > 1e-6:
            errors[n] = (rel(grads[n], t.grad), rel(p.grad, t.grad))
    over = {n: e for n, e in errors.items() if e[0] > 2 * e[1] + 1e-3}
    worst = max(errors, key=lambda n: errors[n][0] - 2 * errors[n][1])
    return {"loss_sharded": errors["loss"][0], "loss_unsharded": errors["loss"][1], "worst": worst,
            "worst_sharded": errors[worst][0], "worst_unsharded": errors[worst][1], "within_bound": not over,
            "over": sorted(over)}


def bf16(args) -> list[dict]:
    """bf16 autocast on the device: sharded and unsharded errors against the float64 model."""
    rows = []
    for name, build in MODELS.items():
        for mode, q, d in MESHES:
            model, inputs, loss_of = build(args.size)
            inputs = _to(inputs, args.device)
            sharded = functools.partial(tess_compile.simulate, q=q, d=d, example_inputs=inputs, mode=mode)
            row = bf16_errors(sharded, model.to(args.device), inputs, loss_of, args.device)
            rows.append({"model": name, "mode": mode, "ranks": q * q * d, **row})
            print(f"bf16 {name} {mode}: loss {row['loss_sharded']:.1e} vs {row['loss_unsharded']:.1e}, "
                  f"within bound: {row['within_bound']}", flush=True)
    return rows


# ---- real process groups ----------------------------------------------------------------------------


def _compare_step(sharded, model, inputs, loss_of) -> dict:
    """One forward, backward and AdamW step of `sharded` and of `model`: relative errors of
    the loss, every gradient and every weight after the step."""
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss, ref = _unwrap(loss_of(_unwrap(_call(sharded, inputs)))), loss_of(_call(model, inputs))
    loss.backward()
    ref.backward()
    params = dict(sharded.named_parameters())
    errors = {"loss": rel(loss, ref)}
    for n, p in model.named_parameters():
        if p.grad is not None:
            errors[f"grad {n}"] = rel(tess_compile.full_tensor(params[n].grad), p.grad)
    opt.step()
    ref_opt.step()
    for n, p in model.named_parameters():
        errors[f"weight {n}"] = rel(tess_compile.full_tensor(params[n].detach()), p)
    worst = max(errors, key=errors.get)
    return {"worst": errors[worst], "worst_at": worst, "tensors": len(errors)}


def _nccl_worker(rank: int, world: int, size: dict) -> list[dict]:
    torch.cuda.set_device(0)
    rows = []
    for name, build in MODELS.items():
        model, inputs, loss_of = build(size)
        model = model.double().cuda()
        inputs = _to(inputs, "cuda", torch.float64)
        sharded = tess_compile.shard(copy.deepcopy(model), 1, 1, example_inputs=inputs, timeout=120)
        row = _compare_step(sharded, model, inputs, loss_of)
        rows.append({"model": name, "backend": torch.distributed.get_backend(), **row,
                     "param_device": str(next(sharded.parameters()).device)})
    return rows


def nccl1(args) -> list[dict]:
    """A world of one under NCCL (one GPU: NCCL refuses two ranks on one device)."""
    rows = run_local(_nccl_worker, 1, args=(args.size,), backend="nccl", timeout_s=300)[0]
    for row in rows:
        print(f"nccl1 {row['model']}: worst {row['worst']:.1e} ({row['worst_at']})", flush=True)
    return rows


GLOO_OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
            "all_to_all_single")


def _gloo_op(op: str, x: torch.Tensor, world: int) -> None:
    dist = torch.distributed
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "broadcast":
        dist.broadcast(x, 0)
    elif op == "all_gather":
        dist.all_gather([torch.empty_like(x) for _ in range(world)], x)
    elif op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(x.new_empty(world * x.numel()), x)
    elif op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(x.new_empty(x.numel() // world), x)
    else:
        dist.all_to_all_single(torch.empty_like(x), x)


def _gloo_worker(rank: int, world: int, size: dict, device: str, progress: str) -> list[dict]:
    """Each collective the runtime uses on a tensor of `device`, then the sharded step; every
    step is written to `progress` first, so a crash leaves what it was doing."""
    device = torch.device(device, 0) if device == "cuda" else torch.device(device)

    def mark(text: str) -> None:
        with open(f"{progress}.{rank}", "a") as f:
            f.write(text + "\n")

    rows = []
    for op in GLOO_OPS:
        mark(op)
        try:
            _gloo_op(op, torch.ones(8 * world, device=device), world)
            rows.append({"op": op, "ok": True})
        except Exception as error:  # noqa: BLE001 - reported: which collective gloo refuses on this device
            rows.append({"op": op, "ok": False, "error": f"{type(error).__name__}: {str(error)[:200]}"})
    for mode, q, d in [("2.5d", 2, 2), ("1d", 2, 2)]:  # [2,2,2] and p=8
        for summa in (("auto", "broadcast", "overlap", "gather") if mode != "1d" else ("auto",)):
            mark(f"shard {mode} {summa}")
            model, inputs, loss_of = gpt_stack(size)
            model = model.double().to(device)
            inputs = _to(inputs, device, torch.float64)
            row = {"mode": mode, "ranks": q * q * d, "summa": summa}
            try:
                sharded = tess_compile.shard(copy.deepcopy(model), q, d, example_inputs=inputs, mode=mode,
                                             summa=summa, device=device, timeout=60)
                row.update(_compare_step(sharded, model, inputs, loss_of))
            except Exception as error:  # noqa: BLE001 - reported: which collective gloo refuses on this device
                row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            rows.append(row)
    return rows


def gloo8(args) -> list[dict]:
    """8 processes over gloo with tensors on the device (the one GPU shared by all)."""
    progress = os.path.join(tempfile.mkdtemp(prefix="gloo8-"), "progress")
    try:
        rows = run_local(_gloo_worker, 8, args=(args.size, args.device, progress), backend="gloo", timeout_s=300,
                         collective_timeout_s=60)[0]
    except RuntimeError as error:
        last = {}
        for rank in range(8):
            if os.path.exists(f"{progress}.{rank}"):
                with open(f"{progress}.{rank}") as f:
                    last[rank] = f.read().split("\n")[-2]
        return [{"error": str(error)[:8000], "last_step_per_rank": last}]
    for row in rows:
        print(f"gloo8 {row.get('op') or row['mode'] + ' ' + row['summa']}: "
              f"{row.get('worst', row.get('error', 'ok'))}", flush=True)
    return rows


# ---- compiled programs ----------------------------------------------------------------------------------


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_step(step, device, warmup: int = 2, steps: int = 5) -> float:
    times = []
    for number in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if number >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compiled_bf16_worker(size: dict, device: str, q: int, d: int) -> dict:
    """simulate(compile=True) under bf16 autocast on `[q, q, d]`: its error and the unsharded
    bf16 model's against the float64 model (`bf16_errors`), and the first (compiling) step."""
    model, inputs, loss_of = gpt_stack(size)
    inputs = _to(inputs, device)
    start = time.perf_counter()
    row = bf16_errors(lambda m: tess_compile.simulate(m, q, d, example_inputs=inputs, compile=True),
                      model.to(device), inputs, loss_of, device)
    _sync(device)
    return {"model": "gpt_stack", "dtype": "bf16 autocast", "size": size, "mesh": f"[{q},{q},{d}]", **row,
            "first_step_s": time.perf_counter() - start}


def _compiled_worker(rank: int, world: int, size: dict, device: str, q: int, d: int) -> dict:
    """simulate(compile=True) against eager on `[q, q, d]` in float64: parity, the first
    (compiling) step, the median step; first a one-kernel `torch.compile`, to tell the
    machine's inductor from ours."""
    start = time.perf_counter()
    torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8, device=device))
    _sync(device)
    trivial_s = time.perf_counter() - start
    model, inputs, loss_of = gpt_stack(size)
    model = model.double().to(device)
    inputs = _to(inputs, device, torch.float64)
    results = {}
    for name, flag in (("eager", False), ("compiled", True)):
        sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=inputs, compile=flag)
        start = time.perf_counter()
        loss = loss_of(_call(sim, inputs))
        loss.backward()
        _sync(device)
        results[name] = {"first_step_s": time.perf_counter() - start, "loss": loss.detach(), "grads": sim.full_grads()}
        print(f"compiled worker: {name} first step {results[name]['first_step_s']:.1f} s", flush=True)

        def step(sim=sim):
            loss_of(_call(sim, inputs)).backward()

        results[name]["step_s"] = _median_step(step, device)
    errors = {"loss": rel(results["compiled"]["loss"], results["eager"]["loss"])}
    errors.update({n: rel(g, results["eager"]["grads"][n]) for n, g in results["compiled"]["grads"].items()})
    worst = max(errors, key=errors.get)
    return {"model": "gpt_stack", "dtype": "float64", "size": size, "mesh": f"[{q},{q},{d}]",
            "worst_vs_eager": errors[worst], "worst_at": worst, "trivial_compile_s": trivial_s,
            **{f"{k}_{m}": results[k][m] for k in results for m in ("first_step_s", "step_s")}}


def compiled(args, meanwhile=None) -> list[dict]:
    """simulate(compile=True) on the GPT stack: against eager in float64 at [1,1,1] and [2,2,2],
    and under bf16 autocast at [2,2,2] against the float64 model; each in a child with a time
    limit that prints its stack every `--watchdog` seconds (so a hang shows where it hangs),
    `meanwhile()` running beside the first."""
    size = dict(args.size, hidden=4 * args.size["hidden"], seq=8 * args.size["seq"])
    rows = []
    for q, d, work in ((1, 1, "compiled_worker"), (2, 2, "compiled_worker"), (2, 2, "compiled_bf16_worker")):
        limit = min(args.compile_limit, args.deadline - time.perf_counter() - 10)
        if limit < 20:
            rows.append({"mesh": f"[{q},{q},{d}]", "work": work, "error": "skipped: --budget spent"})
            continue
        child = _start_child(args, work, {"size": size, "q": q, "d": d})
        if meanwhile is not None and q == 1:
            meanwhile()
        rows.append({**_one(_finish_child(child, limit)), "mesh": f"[{q},{q},{d}]"})
        result = rows[-1].get("worst_vs_eager", rows[-1].get("within_bound", rows[-1].get("error")))
        print(f"compiled {work} {rows[-1]['mesh']}: {result}", flush=True)
    return rows


def _one(result):
    return dict(result[0]) if isinstance(result, list) else result


# ---- children: a section's work in its own process, with a time limit and a watchdog ------------------


def _in_child(args, work: str, kwargs: dict, limit: float):
    """`CHILD_WORK[work](args, **kwargs)` in a child process, killed after
    `limit` seconds: its result, or {"error", "log_tail"} with the end of its output, where the
    child's watchdog wrote its main thread's stack every `args.watchdog` s."""
    return _finish_child(_start_child(args, work, kwargs), limit)


def _start_child(args, work: str, kwargs: dict) -> dict:
    import subprocess

    folder = tempfile.mkdtemp(prefix="gpu-check-child-")
    spec, log = os.path.join(folder, "spec.json"), os.path.join(folder, "log.txt")
    with open(spec, "w") as f:
        json.dump({"work": work, "kwargs": kwargs, "device": args.device, "quick": args.quick,
                   "watchdog": args.watchdog}, f)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", spec],
                                stdout=out, stderr=subprocess.STDOUT)
    return {"work": work, "proc": proc, "folder": folder, "start": time.perf_counter()}


def _finish_child(child: dict, limit: float):
    import subprocess

    proc, left = child["proc"], limit - (time.perf_counter() - child["start"])
    try:
        code = proc.wait(timeout=max(left, 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    result = os.path.join(child["folder"], "result.json")
    if code == 0 and os.path.exists(result):
        with open(result) as f:
            return json.load(f)
    with open(os.path.join(child["folder"], "log.txt"), errors="replace") as f:
        log = f.read()
    reason = f"did not finish within {limit:.0f} s" if code is None else f"exited with code {code}"
    return {"error": f"{child['work']} {reason}", "seconds": time.perf_counter() - child["start"],
            "log_tail": log[-8000:]}


def _watch_main_thread(every: float) -> None:
    """Print the main thread's Python stack every `every` seconds (a daemon thread: where a
    step hangs; nothing printed while the main thread holds the interpreter in native code)."""
    import threading
    import traceback

    main, start = threading.main_thread().ident, time.perf_counter()

    def watch():
        while True:
            time.sleep(every)
            frame = sys._current_frames().get(main)
            stack = "".join(traceback.format_stack(frame)[-25:]) if frame is not None else "(none)\n"
            print(f"--- watchdog at {time.perf_counter() - start:.0f} s, main thread:\n{stack}", flush=True)

    threading.Thread(target=watch, daemon=True).start()


def child_main(spec_path: str) -> int:
    """The child's side of `_in_child`."""
    import faulthandler

    with open(spec_path) as f:
        spec = json.load(f)
    faulthandler.enable(file=sys.stdout)  # a fatal signal's stack
    _watch_main_thread(spec["watchdog"])
    args = argparse.Namespace(device=spec["device"], quick=spec["quick"],
                              size=SIZES["quick" if spec["quick"] else "full"])
    out = CHILD_WORK[spec["work"]](args, **spec["kwargs"])
    with open(os.path.join(os.path.dirname(spec_path), "result.json"), "w") as f:
        json.dump(out, f, default=lambda v: v.item() if isinstance(v, torch.Tensor) else str(v))
    return 0


# ---- one rank's local program: kernels and memory -----------------------------------------------------


class BufferComm(Comm):
    """Collectives replaced by buffers of their outputs' shapes (random, made once per shape):
    one rank's program runs its local kernels alone."""

    def __init__(self):
        super().__init__()
        self.buffers: dict = {}
        self.fresh = False  # True: every output a new tensor, as a real collective's (memory, CUDA graphs)

    def run(self, op: str, x: torch.Tensor, *args) -> torch.Tensor:
        like = output_like(op, x.to("meta"), *args)  # its shape and dtype, no bytes allocated
        key = (tuple(like.shape), like.dtype, x.device)
        if key not in self.buffers:
            self.buffers[key] = torch.randn(like.shape, dtype=like.dtype, device=x.device) * 0.1
        buffer = self.buffers[key]
        if self.fresh or buffer.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            return buffer.clone()  # an op's output may not alias its input
        return buffer.detach()  # a new tensor object: autograd gives each call's output its own node


def _rank0_shards(program, device) -> nn.Module:
    """Rank 0's shards, drawn at random (weights) or ones (norms and biases)."""
    module = state.add_local_tensors(nn.Module(), program, 0, device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return module


VARIANTS = ("eager", "compiled", "cudagraphs")  # cudagraphs: compiled, with inductor's CUDA graphs


def _forward_of(program, module, inputs, comm, variant: str):
    """Rank 0's forward with `comm`: the program's own graph run eagerly, or compiled by inductor
    (`CompiledRank`, the `compile=True` runtime), with inductor's CUDA graphs for "cudagraphs"."""
    if variant == "eager":
        def run(graph_inputs):
            with use_comm(comm):
                return program.runnable(*graph_inputs)
    else:
        from tess_compile.runtime.inductor import CompiledRank

        rank = CompiledRank(program, backward_comm=lambda: comm)

        def run(graph_inputs):
            with torch._inductor.config.patch({"triton.cudagraphs": variant == "cudagraphs"}):
                return rank(comm, graph_inputs)

    def forward():
        outs = run(state.graph_inputs(program, module, inputs))
        return [t for t in (outs if isinstance(outs, (list, tuple)) else [outs])
                if isinstance(t, torch.Tensor) and t.requires_grad]

    return forward


def local_step(program, inputs: list, device, *, steps: int = 10, variant: str = "eager") -> dict:
    """Rank 0's program forward and backward with `BufferComm`, timed with CUDA events (median
    of `steps`, after 3 warm-up steps, the first of which compiles a compiled `variant`); the
    device's busy fraction (kernel time over wall time, `busy_fraction`); the peak memory of two
    training steps (`step_peak_bytes`): the allocator's, with AdamW's default (foreach on CUDA) and
    for-loop steps, and (eager) `MemTracker`'s."""
    module = _rank0_shards(program, device)
    comm = BufferComm()
    forward = _forward_of(program, module, inputs, comm, variant)

    def backward(roots):
        with use_comm(comm, "backward"):
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])

    def step():
        for p in module.parameters():
            p.grad = None
        backward(forward())

    if variant == "cudagraphs":  # the comm's buffers made before any capture (one made inside would stay in its pool)
        backward(_forward_of(program, module, inputs, comm, "eager")())
        comm.fresh = True  # inductor's CUDA graphs want every output from their pool, in warm-up runs too

    cuda = torch.device(device).type == "cuda"
    fwd, bwd = [], []
    start = time.perf_counter()
    for number in range(3 + steps):
        if number == 1:
            _sync(device)
            first_step_s = time.perf_counter() - start
        for p in module.parameters():
            p.grad = None
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
        roots = forward()
        if cuda:
            events[1].record()
        backward(roots)
        if cuda:
            events[2].record()
            torch.cuda.synchronize()
            if number >= 3:
                fwd.append(events[0].elapsed_time(events[1]) / 1e3)
                bwd.append(events[1].elapsed_time(events[2]) / 1e3)
        del roots
    peak = peak_forloop = busy = None
    if cuda:
        busy = busy_fraction(step, (statistics.median(fwd) + statistics.median(bwd)))
        peak = step_peak_bytes(forward, backward, module, comm, inputs)
        peak_forloop = step_peak_bytes(forward, backward, module, comm, inputs, foreach=False)
    tracked = step_peak_bytes(forward, backward, module, comm, inputs, tracked=True) if variant == "eager" else None
    return {"variant": variant, "forward_s": statistics.median(fwd) if fwd else None,
            "backward_s": statistics.median(bwd) if bwd else None, "first_step_s": first_step_s,
            "busy": busy, "peak_bytes": peak, "peak_bytes_forloop": peak_forloop, "tracked_bytes": tracked}


def step_peak_bytes(forward, backward, module, comm: BufferComm, inputs: list, *, tracked: bool = False,
                    **adamw) -> int:
    """The most bytes held at once in two training steps, as `step_peak` counts them: a new AdamW
    (`adamw` its options; its state made in the first step), every collective's output a new
    tensor. The CUDA allocator's peak, less what it held at the start beyond the parameters and
    inputs (the comm's buffers, cuBLAS's workspace); or with `tracked`, torch's `MemTracker`'s,
    which sees what dispatch sees (the prediction's view), not the buffers kernels make inside."""
    from torch.distributed._tools.mem_tracker import MemTracker

    for p in module.parameters():
        p.grad = None
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, **adamw)
    fresh, comm.fresh = comm.fresh, True
    tracker = MemTracker() if tracked else None
    if tracked:
        tracker.track_external(module, opt, *inputs)
    else:
        torch.cuda.synchronize()
        held = sum(t.numel() * t.element_size() for t in [*module.parameters(), *inputs])
        base = torch.cuda.memory_allocated() - held
        torch.cuda.reset_peak_memory_stats()
    with tracker or contextlib.nullcontext():
        for _ in range(2):
            if tracked:
                tracker.reset_mod_stats()  # the tracker refuses a module's second call otherwise
            backward(forward())
            opt.step()
            opt.zero_grad(set_to_none=True)
    comm.fresh = fresh
    if tracked:
        peaks = tracker.get_tracker_snapshot("peak")  # per device; the comm's shape probes are on meta
        return max(v["Total"] for device, v in peaks.items() if torch.device(device).type != "meta")
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def busy_fraction(step, step_s: float, steps: int = 5) -> float:
    """The device's busy fraction in a step: the union of its kernels' (and copies') intervals
    over `steps` profiled steps, per step, over `step_s`, the step's wall time measured without the
    profiler (whose own host cost would lengthen a host-bound step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, -math.inf
    for lo, hi in spans:  # union of intervals, in microseconds
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / 1e6 / steps / step_s


def _profile_terms(program) -> dict:
    """The kernels the cost model counts per phase, and the collectives each phase runs."""
    profile = profile_program(program)
    collectives = {"forward": sum(c.forward_bytes is not None for c in profile.costs),
                   "backward": sum(c.backward_bytes is not None for c in profile.costs)}
    return {phase: {**asdict(profile.phase(phase)), "collectives": collectives[phase]}
            for phase in ("forward", "backward")}


def _memory_row(program) -> dict:
    estimate = predict_memory(program, MODULE_LOSS)  # the program's own step, as `local_step` runs it
    return {"predicted_bytes": estimate.total, **{f"predicted_{k}": v for k, v in asdict(estimate).items()}}


def _table_rows(args, which: str) -> list:
    """The paper rows a kernels section runs: "all", the compiled section's "few" (`FEW`, in its
    order), or one `[table, shape]`."""
    table = [("1", r) for r in TABLE_1] + [("2", r) for r in TABLE_2]
    if which not in ("all", "few"):  # one row: [table, shape]
        return [(n, r) for n, r in table if [n, r.shape] == list(which)]
    if args.quick:
        return table[:2]
    if which == "few":
        return [next((n, r) for n, r in table if (n, r.shape) == key) for key in FEW]
    return table


# The compiled kernels section's rows, most wanted first (its budget may end it): the host-bound
# Table 1 rows, where CUDA graphs matter, then Table 2's.
FEW = (("1", "[4,4,4]"), ("2", "[4,4,4]"), ("1", "[2,2,2]"), ("2", "[8,8,1]"), ("1", "[64]"), ("2", "[1,1,1]"))


def kernel_rows(args, variant: str = "eager", which="all") -> list[dict]:
    """Each paper row's rank-0 program in bf16, run as `variant`: local forward and backward
    time, TFLOP/s, the device's busy fraction, peak memory against the prediction."""
    rows = []
    seq = 16 if args.quick else SEQ
    for number, row in _table_rows(args, which):
        hidden, heads, batch = (row.hidden, row.heads, row.batch_used) if not args.quick else (64, 16, 8)
        program = compile_layer(row.mesh, batch, hidden, heads, seq, dtype=torch.bfloat16, checkpoint=True)
        x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, device=args.device)
        measured = local_step(program, [x], args.device, variant=variant)
        terms = _profile_terms(program)
        flops = terms["forward"]["matmul_flops"] + terms["backward"]["matmul_flops"]
        seconds = (measured["forward_s"] or math.nan) + (measured["backward_s"] or math.nan)
        out = {"table": number, "method": row.method, "shape": row.shape, "batch": batch, "hidden": hidden,
               "mode": row.mesh.mode, "ranks": row.mesh.num_ranks, **measured, "terms": terms,
               "tflops": flops / seconds / 1e12, **_memory_row(program)}
        rows.append(out)
        print(f"kernels {variant} table {number} {row.method} {row.shape}: fwd {out['forward_s']}, "
              f"bwd {out['backward_s']}, {out['tflops']:.1f} TFLOP/s, busy {out['busy']}", flush=True)
    return rows


def kernels(args) -> list[dict]:
    """Every paper row's rank-0 program in bf16, eager."""
    return kernel_rows(args)


def kernels_compiled(args) -> list[dict]:
    """A few paper rows' rank-0 programs eager, compiled, and compiled with CUDA graphs: the
    compiled ones each in a child, while `--budget` lasts."""
    rows = []
    for number, row in _table_rows(args, "few"):
        rows.extend(kernel_rows(args, "eager", [number, row.shape]))
        for variant in VARIANTS[1:]:
            left = args.deadline - time.perf_counter()
            if left < 30:
                rows.append({"table": number, "shape": row.shape, "variant": variant, "error": "skipped: --budget spent"})
                continue
            out = _in_child(args, "kernel_rows", {"variant": variant, "which": [number, row.shape]},
                            min(args.compile_limit, left - 10))
            rows.extend(out if isinstance(out, list) else [{"table": number, "shape": row.shape, "variant": variant,
                                                            **out}])
    return rows


def memory(args) -> list[dict]:
    """The GPT stack's rank-0 program in each mode and recompute option: peak memory."""
    size = ({"layers": 2, "hidden": 1024, "heads": 16, "batch": 16, "seq": 512} if not args.quick
            else {"layers": 1, "hidden": 64, "heads": 8, "batch": 8, "seq": 8})
    rows = []
    for mode, q, d in [("1d", 2, 2), ("2d", 2, 1), ("2.5d", 2, 2), ("3d", 2, 2)]:
        for recompute in ("none", "blocks", "selective"):
            torch.manual_seed(0)
            with torch.device("meta"):
                model = Stack(size["layers"], size["hidden"], size["heads"]).to(torch.bfloat16)
                example = torch.empty(size["batch"], size["seq"], size["hidden"], dtype=torch.bfloat16)
            program = compile_model(model, Mesh(q, d, mode), (example,), recompute=recompute)
            x = torch.randn(example.shape, dtype=torch.bfloat16, device=args.device)
            measured = local_step(program, [x], args.device, steps=2)
            out = {"mode": mode, "ranks": program.mesh.num_ranks, "recompute": recompute, **measured,
                   **_memory_row(program)}
            rows.append(out)
            print(f"memory {mode} p={out['ranks']} {recompute}: peak {out['peak_bytes']}, "
                  f"tracked {out['tracked_bytes']}, predicted {out['predicted_bytes']}", flush=True)
    return rows


# ---- a world of one against torch.compile ------------------------------------------------------------


def _world1_worker(rank: int, world: int, size: dict, device: str) -> dict:
    """The GPT stack in bf16 under NCCL in a world of one: the unsharded model under
    `torch.compile`, and `shard(model, 1, 1, compile=True)`: a training step's median time
    (forward, backward, AdamW), the first (compiling) step, and the loss after 3 steps."""
    if device == "cuda":
        torch.cuda.set_device(0)
    model, inputs, loss_of = gpt_stack(size)
    model = model.to(device, torch.bfloat16)
    inputs = _to(inputs, device, torch.bfloat16)
    out = {}
    for name in ("torch.compile", "tess compile=True", "tess eager"):
        copy_ = copy.deepcopy(model)
        if name == "torch.compile":
            run = torch.compile(copy_)
        else:
            run = tess_compile.shard(copy_, 1, 1, example_inputs=inputs, compile=name != "tess eager", timeout=300)
        opt = torch.optim.AdamW(run.parameters(), lr=1e-4)

        def step(run=run, opt=opt):
            loss = loss_of(_unwrap(_call(run, inputs)))
            loss = _unwrap(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        def forward_backward(run=run):
            _unwrap(loss_of(_unwrap(_call(run, inputs)))).backward()

        start = time.perf_counter()
        step()
        _sync(device)
        first = time.perf_counter() - start
        out[name] = {"first_step_s": first, "step_s": _median_step(step, device, warmup=3, steps=10),
                     "forward_backward_s": _median_step(forward_backward, device, warmup=1, steps=10)}
        print(f"world1 {name}: first {first:.1f} s, step {out[name]['step_s'] * 1e3:.2f} ms", flush=True)
    return {"size": size, "dtype": "bfloat16", **out,
            "ratio": out["tess compile=True"]["step_s"] / out["torch.compile"]["step_s"],
            "ratio_forward_backward": (out["tess compile=True"]["forward_backward_s"]
                                       / out["torch.compile"]["forward_backward_s"])}


WORLD1_SIZES = {"full": {"layers": 2, "hidden": 1024, "heads": 16, "batch": 8, "seq": 512},
                "quick": {"layers": 1, "hidden": 64, "heads": 8, "batch": 4, "seq": 8}}


def world1(args) -> list[dict]:
    """A world of one: tess-compile's compiled program against the unsharded model under torch.compile."""
    size = WORLD1_SIZES["quick" if args.quick else "full"]
    try:
        return run_local(_world1_worker, 1, args=(size, args.device), backend=_backend(args.device),
                         timeout_s=max(min(args.compile_limit * 2, args.deadline - time.perf_counter()), 10))
    except (RuntimeError, TimeoutError) as error:
        return [{"error": str(error)[:4000]}]


ADAMW_OPTIONS = {"default": {}, "for-loop": {"foreach": False}, "fused": {"fused": True}}


def _adamw_worker(rank: int, world: int, size: dict, device: str) -> dict:
    """AdamW's step over the world-of-one model's parameters (bf16), as plain tensors and as
    DTensors on a mesh of one (as `shard(model, 1, 1)` holds them), with each of
    `ADAMW_OPTIONS`: the median step in seconds, or the error."""
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = Stack(size["layers"], size["hidden"], size["heads"]).to(device, torch.bfloat16)
    mesh = DeviceMesh(torch.device(device).type, [0])
    kinds = {"plain": [nn.Parameter(p.detach().clone()) for p in model.parameters()],
             "dtensor": [nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])) for p in model.parameters()]}
    out = {}
    for kind, params in kinds.items():
        for name, options in ADAMW_OPTIONS.items():
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            try:
                opt = torch.optim.AdamW(params, lr=1e-4, **options)
                out[f"{kind} {name}"] = _median_step(opt.step, device, warmup=5, steps=10)
            except (RuntimeError, ValueError) as error:  # an implementation this device or torch lacks
                out[f"{kind} {name}"] = f"{type(error).__name__}: {str(error)[:200]}"
            print(f"adamw {kind} {name}: {out[f'{kind} {name}']}", flush=True)
    return {"parameters": len(kinds["plain"]), "size": size, "seconds": out}


def adamw(args) -> list[dict]:
    """AdamW's step over plain and DTensor parameters in a world of one: what DTensor parameters
    add to the step of `world1` beyond the program."""
    return run_local(_adamw_worker, 1, args=(WORLD1_SIZES["quick" if args.quick else "full"], args.device),
                     backend=_backend(args.device), timeout_s=300)


def _backend(device) -> str:
    """The process group backend of a world of one on `device`."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# The work a child of `_in_child` runs, by name.
CHILD_WORK = {
    "compiled_worker": lambda args, size, q, d: _compiled_worker(0, 1, size, args.device, q, d),
    "compiled_bf16_worker": lambda args, size, q, d: _compiled_bf16_worker(size, args.device, q, d),
    "kernel_rows": kernel_rows,
}


# ---- the run and its record ----------------------------------------------------------------------


def environment(device) -> dict:
    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "device": str(device)}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(name=props.name, memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}")
        env["bf16_peak_flops"] = next((v for k, v in BF16_PEAK.items() if k in props.name), None)
        env["bf16_matmul_flops"] = _matmul_rate(device)
    return env


def _matmul_rate(device, n: int = 8192) -> float:
    """bf16 FLOP/s of an n x n x n product on random data (median of 10 after 3)."""
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    times = []
    for number in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if number >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def run(args) -> dict:
    """Every section of `args.sections`, the record rewritten after each."""
    record = {"environment": environment(args.device), "sections": {}, "errors": {}}
    print(json.dumps(record["environment"]), flush=True)
    beside = "gloo8" if {"compiled", "gloo8"} <= set(args.sections) else None  # runs while compiled's children compile
    for name in args.sections:
        if name == beside:
            continue
        if name == "compiled" and beside:
            _section(record, name, args.out, lambda: compiled(args, lambda: _section(record, beside, args.out,
                                                                                          lambda: gloo8(args))))
        else:
            _section(record, name, args.out, lambda name=name: globals()[name](args))
    return record


def _section(record: dict, name: str, out: str, work) -> None:
    """Section `name`'s rows, `work()` (or its error), into `record`, written to `out`."""
    start = time.perf_counter()
    try:
        record["sections"][name] = work()
    except Exception:  # noqa: BLE001 - recorded, the next section still runs
        record["errors"][name] = traceback.format_exc()[-3000:]
        print(f"{name} failed:\n{record['errors'][name]}", flush=True)
    record.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
    _write(record, out)


def _write(record: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=lambda v: v.item() if isinstance(v, torch.Tensor) else str(v))


# ---- report: tables and the fitted compute constants ------------------------------------------------


HOST_FIT = ("matmul_half_size", "memory_bandwidth GB/s", "per kernel us", "per forward collective us",
            "per backward collective us", "per phase us")
_HOST_SCALE = (100.0, 1e12, 1e-5, 1e-5, 1e-5, 1e-3)  # each fitted constant is |x| * scale


def local_seconds(row: dict, x, flops: float) -> tuple[float, float]:
    """(forward, backward) seconds of a rank-program alone: the larger of the device's work
    (products at `flops` slowed by their smallest dimension, other kernels at a memory bandwidth)
    and the host's (a cost per kernel, per collective and per phase), which launches the
    kernels ahead of the device until it is the slower; constants `x` scaled by `_HOST_SCALE`."""
    half, bandwidth, kernel, forward_coll, backward_coll, phase = (abs(v) * s for v, s in zip(x, _HOST_SCALE))
    out = []
    for name, coll in (("forward", forward_coll), ("backward", backward_coll)):
        t = row["terms"][name]
        device = (t["matmul_flops"] + t["matmul_flops_per_size"] * half) / flops + t["memory_bytes"] / bandwidth
        host = kernel * t["num_kernels"] + coll * t["collectives"] + phase
        out.append(max(device, host))
    return tuple(out)


def _least_squares(loss, spread: list[float]):
    """The constants minimising `loss` (Nelder-Mead from 16 fixed random starts within `spread`:
    a max of terms is not smooth)."""
    import numpy as np
    from scipy.optimize import minimize  # the bench extra: pip install -e '.[bench]'

    starts = np.random.RandomState(0).rand(16, len(spread)) * spread
    fits = [minimize(loss, x0, method="Nelder-Mead", options={"maxiter": 20000, "xatol": 1e-6, "fatol": 1e-12})
            for x0 in starts]
    return min(fits, key=lambda f: f.fun).x


def fit_local(rows: list[dict], flops: float):
    """The constants of `local_seconds` that best explain the measured forward and backward
    times (least squares on log seconds)."""
    def loss(x):
        return sum(math.log(p / r[f"{n}_s"]) ** 2 for r in rows
                   for p, n in zip(local_seconds(r, x, flops), ("forward", "backward")))

    return _least_squares(loss, [5, 3, 10, 10, 10, 2])


# The split fit: the device's terms fitted to the device's own time in each row (the step's
# kernel time, busy fraction x step), the host's to the steps of host-bound rows.
DEVICE_FIT = ("matmul_half_size", "memory_bandwidth GB/s", "per kernel on the device us")
HOST_BOUND = 0.5  # a row whose device is busy less than this is host-bound: its step is the host's time


def _step_s(row: dict) -> float:
    return row["forward_s"] + row["backward_s"]


def device_seconds(row: dict, x, flops: float) -> float:
    """A step's kernel time: products at `flops` slowed by their smallest dimension, other
    kernels' bytes at a bandwidth, and a latency per kernel; constants `x` as `DEVICE_FIT`
    (scaled by 100, 1e12 and 1e-6)."""
    half, bandwidth, latency = abs(x[0]) * 100, abs(x[1]) * 1e12, abs(x[2]) * 1e-6
    return sum((t["matmul_flops"] + t["matmul_flops_per_size"] * half) / flops + t["memory_bytes"] / bandwidth
               + latency * t["num_kernels"] for t in (row["terms"]["forward"], row["terms"]["backward"]))


def host_seconds(row: dict, y) -> float:
    """A step's host time: a cost per kernel, per collective and per phase (scaled by 1e-5, 1e-5, 1e-3)."""
    kernel, collective, phase = abs(y[0]) * 1e-5, abs(y[1]) * 1e-5, abs(y[2]) * 1e-3
    return sum(kernel * t["num_kernels"] + collective * t["collectives"] + phase
               for t in (row["terms"]["forward"], row["terms"]["backward"]))


def fit_split(rows: list[dict], flops: float):
    """(device constants, host constants) of the split fit on `rows`; host None where no row is host-bound."""
    x = _least_squares(lambda x: sum(math.log(device_seconds(r, x, flops) / (r["busy"] * _step_s(r))) ** 2
                                     for r in rows), [5, 5, 5])
    bound = [r for r in rows if r["busy"] < HOST_BOUND]
    y = _least_squares(lambda y: sum(math.log(host_seconds(r, y) / _step_s(r)) ** 2 for r in bound),
                       [5, 10, 2]) if bound else None
    return x, y


def _errors(rows: list[dict], x, flops: float) -> list[float]:
    return [abs(sum(local_seconds(r, x, flops)) / _step_s(r) - 1) for r in rows]


def report(path: str) -> int:
    with open(path) as f:
        record = json.load(f)
    env, sections = record["environment"], record["sections"]
    print(f"{env.get('name', env['device'])}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}")
    for name, error in record.get("errors", {}).items():
        print(f"section {name} failed: {error.strip().splitlines()[-1]}")
    for name in ("exact", "bf16", "nccl1", "gloo8", "compiled", "world1"):
        for row in sections.get(name, []):
            print(name, {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in row.items() if k != "log_tail"})
    if sections.get("memory"):
        _report_memory(sections["memory"])
    for row in sections.get("adamw", []):
        print("\nAdamW step ms: " + ", ".join(f"{k} {1e3 * v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in row["seconds"].items()))
    rows = [r for r in sections.get("kernels", []) if r.get("forward_s")]
    if rows:
        _report_kernels(rows, env)
    variants = [r for r in sections.get("kernels_compiled", []) if "error" in r or r.get("forward_s")]
    if variants:
        _report_variants(variants, env)
    return 0


def _report_memory(rows: list[dict]) -> None:
    """The memory section: each row's peaks against the prediction (error = predicted / measured - 1)."""
    mib = 2**20
    print(f"\n{'mode':<5} {'ranks':>5} {'recompute':<10} {'allocator MiB':>13} {'tracked MiB':>11} "
          f"{'predicted MiB':>13} {'vs allocator':>12} {'vs tracked':>10}")
    for r in rows:
        peak, tracked, predicted = r.get("peak_bytes"), r.get("tracked_bytes"), r["predicted_bytes"]
        cells = [f"{v / mib:{w}.1f}" if v else f"{'-':>{w}}" for v, w in ((peak, 13), (tracked, 11), (predicted, 13))]
        errors = [f"{100 * (predicted / v - 1):{w}.1f}%" if v else f"{'-':>{w + 1}}" for v, w in ((peak, 11), (tracked, 9))]
        print(f"{r['mode']:<5} {r['ranks']:>5} {r['recompute']:<10} {' '.join(cells)} {' '.join(errors)}")


def _report_split_fit(rows: list[dict], flops: float) -> None:
    """Each table's split fit (`fit_split`), checked on the other table's steps: the larger of
    the predicted device and host times against the measured step."""
    print(f"\nsplit fit (device terms to each row's kernel time, host terms to rows under "
          f"{100 * HOST_BOUND:.0f}% busy):")
    for fit_on, held_out in (("1", "2"), ("2", "1")):
        x, y = fit_split([r for r in rows if r["table"] == fit_on], flops)
        if y is None:
            print(f"  fitted to Table {fit_on}: no host-bound row, so no host constants; Table {held_out} not predicted")
            continue
        held = [r for r in rows if r["table"] == held_out]
        step = statistics.mean(abs(max(device_seconds(r, x, flops), host_seconds(r, y)) / _step_s(r) - 1) for r in held)
        device = statistics.mean(abs(device_seconds(r, x, flops) / (r["busy"] * _step_s(r)) - 1) for r in held)
        constants = (f"{abs(x[0]) * 100:.0f}, {abs(x[1]) * 1e3:.0f} GB/s, {abs(x[2]):.1f} us a kernel on the device; "
                     f"host {abs(y[0]) * 10:.1f} us a kernel, {abs(y[1]) * 10:.1f} us a collective, "
                     f"{abs(y[2]):.2f} ms a phase")
        print(f"  fitted to Table {fit_on} ({constants}): mean error {100 * step:.1f}% on Table {held_out}'s steps, "
              f"{100 * device:.1f}% on its kernel time")


def _report_variants(rows: list[dict], env: dict) -> None:
    """The compiled kernels section: each row eager, compiled and with CUDA graphs, side by side."""
    peak = env.get("bf16_peak_flops") or env["bf16_matmul_flops"]
    print(f"\n{'table':>5} {'shape':<10} {'variant':<11} {'step ms':>8} {'TFLOP/s':>8} {'% peak':>7} {'busy %':>7} "
          f"{'compile s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['table']:>5} {r['shape']:<10} {r['variant']:<11} {r['error'].splitlines()[0]}")
            continue
        print(f"{r['table']:>5} {r['shape']:<10} {r['variant']:<11} {(r['forward_s'] + r['backward_s']) * 1e3:8.2f} "
              f"{r['tflops']:8.1f} {100 * r['tflops'] * 1e12 / peak:7.1f} {100 * r['busy']:7.1f} "
              f"{r['first_step_s']:9.1f}")


def _report_kernels(rows: list[dict], env: dict) -> None:
    flops = env["bf16_matmul_flops"]
    peak = env.get("bf16_peak_flops") or flops
    x = fit_local(rows, flops)
    constants = ", ".join(f"{name} {abs(v) * s / (1e9 if 'GB' in name else 1e-6 if 'us' in name else 1):.1f}"
                          for name, v, s in zip(HOST_FIT, x, _HOST_SCALE))
    errors = _errors(rows, x, flops)
    print(f"\nlocal step = max(device, host) per phase, fitted to all {len(rows)} rank-programs: {constants}; "
          f"mean error {100 * statistics.mean(errors):.1f}%")
    for fit_on, held_out in (("1", "2"), ("2", "1")):
        held = [r for r in rows if r["table"] == held_out]
        x_part = fit_local([r for r in rows if r["table"] == fit_on], flops)
        print(f"fitted to Table {fit_on} only: mean error {100 * statistics.mean(_errors(held, x_part, flops)):.1f}% "
              f"on Table {held_out}")
    if all(r.get("busy") for r in rows):
        _report_split_fit(rows, flops)
    print(f"\n{'table':>5} {'method':<12} {'shape':<10} {'fwd ms':>7} {'bwd ms':>7} {'TFLOP/s':>8} {'% peak':>7} "
          f"{'pred ms':>8} {'err %':>6} {'busy %':>7}")
    for r in rows:
        predicted = sum(local_seconds(r, x, flops))
        total = r["forward_s"] + r["backward_s"]
        print(f"{r['table']:>5} {r['method']:<12} {r['shape']:<10} {r['forward_s'] * 1e3:7.2f} "
              f"{r['backward_s'] * 1e3:7.2f} {r['tflops']:8.1f} {100 * r['tflops'] * 1e12 / peak:7.1f} "
              f"{predicted * 1e3:8.2f} {100 * (predicted / total - 1):6.1f} "
              f"{100 * r['busy'] if r.get('busy') is not None else math.nan:7.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a dry run, on the CPU too)")
    parser.add_argument("--report", metavar="JSON", help="print a results file's tables and the fit")
    parser.add_argument("--watchdog", type=float, default=30.0,
                        help="seconds between a child's stack dumps (where a compile hangs)")
    parser.add_argument("--compile-limit", type=float, default=150.0,
                        help="seconds a compiled section's child may take")
    parser.add_argument("--budget", type=float, default=math.inf,
                        help="seconds after which the compiled sections start no more rows")
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    args.deadline = time.perf_counter() + args.budget
    if args.report:
        return report(args.report)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; skipped")
        return 0
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    args.size = SIZES["quick" if args.quick else "full"]
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
