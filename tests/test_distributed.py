"""Real multi-process runs of `tess_compile.shard` on gloo (CPU).

Each test starts a few local processes with `tess_compile.runtime.launch.run_local`;
launches are expensive (8 processes on a small machine take ~15-20 s), so
one launch per mesh does many checks and returns numbers and small tensors
that the parent asserts on.

Every rank builds the same model from the same seed, so the unsharded model
(the oracle) is available on every rank: a rank compares the global output
(`DTensor.full_tensor()`) with the oracle's, and the local tensor of each of
its parameters' gradients (DTensors, like the parameters) with the block of
the oracle's gradient that the slot's layout gives it (`local_block`).

Precision (as in test_training.py): the GPT block with biases trains in
float64, because its key bias has an exactly-zero gradient whose fp32
rounding noise AdamW amplifies into order-lr steps; the Llama block (no
biases) runs in fp32, TF32 being irrelevant on CPU.
"""

from __future__ import annotations

import copy
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
from models import GPTBlock, LlamaBlock

import tess_compile
from tess_compile.core.layout import Shard, local_block
from tess_compile.core.mesh import Mesh
from tess_compile.runtime.launch import run_local

pytestmark = pytest.mark.slow  # the whole file: real multi-process gloo runs

HIDDEN, HEADS, SEQ = 8, 2, 4
RTOL = 1e-5
STEPS = 5
# label -> (model class, dtype); see the module docstring for the dtypes.
MODELS = {"gpt": (GPTBlock, torch.float64), "llama": (LlamaBlock, torch.float32)}


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    """max |actual - expected| relative to `scale`, by default the largest |expected|
    (inf on a shape mismatch or NaN)."""
    if actual is None or tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    a, e = actual.detach().double(), expected.detach().double()
    if scale is None:
        scale = e.abs().max().item() if e.numel() else 0.0
    scale = max(scale, 1e-12)
    err = (a - e).abs().max().item() if e.numel() else 0.0
    return float("inf") if err != err else err / scale  # NaN counts as a failure


def make_case(label: str, q: int, d: int):
    """The model, input and loss weights of one case, identical on every rank (and the parent)."""
    cls, dtype = MODELS[label]
    torch.manual_seed(11 if label == "gpt" else 12)
    model = cls(HIDDEN, HEADS).to(dtype)
    with torch.no_grad():  # norm weights start at ones and biases at 0-ish: make every tensor distinct
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    x = torch.randn(2 * d * q, SEQ, HIDDEN, dtype=dtype)
    target = torch.randn(2 * d * q, SEQ, HIDDEN, dtype=dtype)
    return model, x, target


def error_text(call) -> str | None:
    """The ValueError message of `call()`, or a description of what happened instead."""
    try:
        call()
    except ValueError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001  (reported to the parent, which fails the test)
        return f"UNEXPECTED {type(err).__name__}: {err}"
    return "UNEXPECTED: no error"


# ---------------------------------------------------------------------------
# Worker functions (module level, so that spawned children can import them)
# ---------------------------------------------------------------------------


def _parity_worker(rank, world_size, q, d, mode, summa):
    """Forward, gradients, AdamW steps and state dicts of both blocks on [q, q, d] in `mode`,
    the matrix products in schedule `summa`."""
    torch.set_num_threads(1)
    mesh = Mesh(q, d, mode)
    out = {"errors": {}, "problems": [], "counts": {}, "shards": {}, "keys": {}}

    # A mesh that does not fit this world is refused before anything is sent.
    other = (2, 2) if world_size == 4 else (2, 1)
    model, x, _ = make_case("llama", q, d)
    out["mismatch"] = error_text(lambda: tess_compile.shard(model, *other, example_inputs=(x,)))

    for label in MODELS:
        errors = out["errors"][label] = {}
        model, x, target = make_case(label, q, d)
        reference = copy.deepcopy(model)
        initial = copy.deepcopy(model.state_dict())
        sm = tess_compile.shard(model, q, d, example_inputs=(x,), mode=mode, summa=summa, timeout=60)

        params = dict(sm.named_parameters())
        names = [name for name, _ in reference.named_parameters()]
        if list(params) != names:
            out["problems"].append(f"{label}: sharded parameter names {list(params)} != {names}")
        if [s.name for s in sm.program.params] != names:
            out["problems"].append(f"{label}: program.params {[s.name for s in sm.program.params]} != {names}")
        if sm.mesh != mesh:
            out["problems"].append(f"{label}: sm.mesh {sm.mesh} != {mesh}")
        for slot in sm.program.params:
            block = local_block(initial[slot.name], slot.layout, mesh, rank)
            if not torch.equal(params[slot.name].to_local(), block):
                out["problems"].append(f"{label}: initial shard of {slot.name} is not this rank's block")
        start_state = sm.full_state_dict()
        for name, value in initial.items():
            if not torch.equal(start_state[name], value):
                out["problems"].append(f"{label}: full_state_dict()[{name!r}] before training != the model's")

        # Forward and backward against the oracle.
        result = sm(x)
        if not isinstance(result, torch.distributed.tensor.DTensor):
            out["problems"].append(f"{label}: output is a {type(result).__name__}, not a DTensor")
        got = result.full_tensor()
        expected = reference(x)
        errors["output"] = rel_err(got, expected)
        (got * target).sum().backward()
        (expected * target).sum().backward()
        for slot in sm.program.params:
            grad = params[slot.name].grad
            if grad is None:
                out["problems"].append(f"{label}: gradient of {slot.name} is None on rank {rank}")
                continue
            oracle = local_block(dict(reference.named_parameters())[slot.name].grad, slot.layout, mesh, rank)
            errors[f"grad {slot.name}"] = rel_err(grad.to_local(), oracle)
        out["counts"][label] = (sm.comm.counts("forward"), sm.comm.counts("backward"))
        first_output = expected.detach().clone()

        # AdamW steps: per-step loss, then the gathered weights.
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-2, weight_decay=0.1)
        opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(STEPS):
            opt.zero_grad()
            opt_ref.zero_grad()
            loss = (sm(x).full_tensor() * target).sum()
            out_ref = reference(x)
            loss_ref = (out_ref * target).sum()
            # A sum with cancellations: its rounding error scales with the sum of |terms|.
            errors[f"loss step {step}"] = rel_err(loss, loss_ref, (out_ref * target).abs().sum().item())
            loss.backward()
            loss_ref.backward()
            opt.step()
            opt_ref.step()
        state = sm.full_state_dict()
        if list(state) != list(reference.state_dict()):
            out["problems"].append(f"{label}: full_state_dict keys {list(state)} != {list(reference.state_dict())}")
        for name, value in reference.state_dict().items():
            errors[f"state {name}"] = rel_err(state.get(name), value)
            if torch.equal(value, initial[name]):
                out["problems"].append(f"{label}: {name} did not move in {STEPS} steps: the check would be blind")
        out["shards"][label] = {name: p.to_local().detach().clone() for name, p in params.items()}
        # Which block a rank holds: its coordinates on the axes where the layout splits.
        out["keys"][label] = {
            s.name: tuple(mesh.coord(rank, a) if isinstance(s.layout.on(a), Shard) else None for a in ("depth", "row", "col"))
            for s in sm.program.params
        }

        # Loading the initial weights back gives the initial output again.
        sm.load_full_state_dict(initial)
        errors["output after load_full_state_dict"] = rel_err(sm(x).full_tensor(), first_output)
    return out


def _timeout_worker(rank, world_size, done_dir):
    """Rank 1 never calls forward; the others must fail within the shard timeout.

    Rank 1 sleeps up to 15 s, but stops early once the others have left a file
    in `done_dir` (so the test does not always cost the full 15 s).
    """
    torch.set_num_threads(1)
    model, x, _ = make_case("gpt", 2, 1)
    sm = tess_compile.shard(model, 2, 1, example_inputs=(x,), timeout=3)
    done = pathlib.Path(done_dir)
    if rank == 1:
        start = time.monotonic()
        while time.monotonic() - start < 15 and len(list(done.glob("done-*"))) < world_size - 1:
            time.sleep(0.1)
        return None
    start = time.monotonic()
    try:
        sm(x)
        result = {"message": None, "elapsed": time.monotonic() - start}
    except RuntimeError as err:
        result = {"message": str(err), "elapsed": time.monotonic() - start}
    (done / f"done-{rank}").touch()
    return result


def _world_size_worker(rank, world_size):
    """Meshes that do not fit a world of 2 are refused on every rank."""
    model, x, _ = make_case("llama", 2, 1)
    return {
        (2, 1): error_text(lambda: tess_compile.shard(model, 2, 1, example_inputs=(x,))),
        (1, 1): error_text(lambda: tess_compile.shard(model, 1, 1, example_inputs=(x,))),
        (1, 2): error_text(lambda: tess_compile.shard(model, 1, 2, example_inputs=(x,))),
        "world": (dist.get_rank(), dist.get_world_size()),
    }


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def simulated_counts(label: str, q: int, d: int, mode: str, summa: str):
    """Collective counts of one forward and backward in the simulator (one record per collective)."""
    model, x, target = make_case(label, q, d)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode, summa=summa)
    (sim(x) * target).sum().backward()
    return sim.comm.counts("forward"), sim.comm.counts("backward")


# (q, d, mode, summa): the overlapped schedule runs its broadcasts asynchronously on gloo;
# the gather schedule runs all_gather_single and, in backward, reduce_scatter_single.
WORLDS = [(2, 1, "2.5d", "overlap"), (2, 1, "2.5d", "gather"), (2, 2, "2.5d", "broadcast"), (1, 2, "1d", "broadcast")]


@pytest.mark.parametrize("q, d, mode, summa", WORLDS, ids=["q2d1-overlap", "q2d1-gather", "q2d2", "1d-p2"])
def test_sharded_parity_training_and_replicas(q, d, mode, summa):
    mesh = Mesh(q, d, mode)
    world = mesh.num_ranks
    results = run_local(_parity_worker, world, args=(q, d, mode, summa), timeout_s=240, collective_timeout_s=60)
    assert len(results) == world

    for rank, res in enumerate(results):
        assert res["problems"] == [], f"rank {rank} {mesh.coords(rank)}:\n" + "\n".join(res["problems"])
        msg = res["mismatch"]
        other = 8 if world == 4 else 4
        assert f"world size {world}" in msg and str(other) in msg, f"rank {rank}: {msg}"
        for label, errors in res["errors"].items():
            bad = {name: err for name, err in errors.items() if not err <= RTOL}
            assert not bad, f"rank {rank} {mesh.coords(rank)} {label}: errors beyond {RTOL}: {bad}"
            assert any(name.startswith("grad ") for name in errors), f"{label}: no gradient was checked"

    # SPMD: every rank ran the same collectives, and the same ones as the simulator.
    for label in MODELS:
        forward0, backward0 = results[0]["counts"][label]
        assert sum(forward0.values()) > 0 and sum(backward0.values()) > 0
        for rank, res in enumerate(results):
            forward, backward = res["counts"][label]
            assert forward == forward0, f"{label}: forward collectives of rank {rank} {forward} != rank 0 {forward0}"
            assert backward == backward0, f"{label}: backward collectives of rank {rank} {backward} != rank 0 {backward0}"
        sim_forward, sim_backward = simulated_counts(label, q, d, mode, summa)
        assert forward0 == sim_forward, f"{label}: distributed forward {forward0} != simulated {sim_forward}"
        assert backward0 == sim_backward, f"{label}: distributed backward {backward0} != simulated {sim_backward}"
        if mesh.size("depth") > 1:  # weights are replicated over depth: their gradients must be summed over it
            assert backward0.get(("all_reduce", "depth"), 0) > 0, f"{label}: no depth all-reduce in backward {backward0}"
        else:
            assert not any(axis == "depth" for _, axis in forward0 | backward0)

    # Replicas stay bit-identical after the AdamW steps.
    for label in MODELS:
        names = list(results[0]["shards"][label])
        for name in names:
            if mesh.size("depth") > 1:  # ranks that differ only in depth hold identical copies of every parameter
                for rank in range(q * q):
                    for k in range(1, d):
                        twin = k * q * q + rank
                        a, b = results[rank]["shards"][label][name], results[twin]["shards"][label][name]
                        assert torch.equal(a, b), (
                            f"{label} {name}: rank {twin} {mesh.coords(twin)} differs from its depth replica "
                            f"rank {rank} {mesh.coords(rank)} after {STEPS} AdamW steps "
                            f"(max diff {(a - b).abs().max().item():.3e})"
                        )
            # More generally, ranks that hold the same block (by layout) hold equal bits.
            groups: dict = {}
            for rank, res in enumerate(results):
                groups.setdefault(res["keys"][label][name], []).append(rank)
            for group in groups.values():
                first = results[group[0]]["shards"][label][name]
                for rank in group[1:]:
                    assert torch.equal(results[rank]["shards"][label][name], first), (
                        f"{label} {name}: rank {rank} {mesh.coords(rank)} differs from replica rank {group[0]}"
                    )


def test_collective_timeout_names_the_collective(tmp_path):
    results = run_local(_timeout_worker, 4, args=(str(tmp_path),), timeout_s=90, collective_timeout_s=30)
    assert results[1] is None
    for rank in (0, 2, 3):
        res = results[rank]
        assert res["message"] is not None, f"rank {rank}: forward finished although rank 1 never called it"
        assert "tess collective" in res["message"], f"rank {rank}: {res['message']}"
        assert f"failed on rank {rank}" in res["message"], f"rank {rank}: {res['message']}"
        assert "within 3s" in res["message"], f"rank {rank}: the message should name the timeout: {res['message']}"
        # Not waiting for the sleeper (15 s): the 3 s timeout (plus slack for a busy machine) ended it.
        assert res["elapsed"] < 14, f"rank {rank} took {res['elapsed']:.1f} s: {res['message']}"


def test_world_size_mismatch_is_refused():
    results = run_local(_world_size_worker, 2, timeout_s=90, collective_timeout_s=30)
    for rank, res in enumerate(results):
        assert res["world"] == (rank, 2)
        msg = res[(2, 1)]
        assert msg.startswith("world size 2") and "4" in msg and "UNEXPECTED" not in msg, f"rank {rank}: {msg}"
        msg = res[(1, 1)]
        assert msg.startswith("world size 2") and "= 1" in msg, f"rank {rank}: {msg}"
        msg = res[(1, 2)]
        assert "d=2 > q=1" in msg and "UNEXPECTED" not in msg, f"rank {rank}: {msg}"


def test_shard_without_process_group_is_refused():
    assert not dist.is_initialized(), "this test needs a process without a default process group"
    model, x, _ = make_case("llama", 2, 1)
    with pytest.raises(ValueError, match="init_process_group") as info:
        tess_compile.shard(model, 2, 1, example_inputs=(x,))
    assert "4 ranks" in str(info.value) and "simulate" in str(info.value)
