"""Training like PyTorch over real gloo processes: DTensor parameters, clipping, DCP resume, rank checks.

One launch of 8 processes on [2,2,2] (d > 1) trains a small tied-embedding
attention model in float64 beside the unsharded model with PyTorch's own
tools on `sharded.parameters()`: `torch.nn.utils.clip_grad_norm_`, foreach
AdamW, `get_model_state_dict` / `get_optimizer_state_dict` through DCP. The
model has no norm layer, so float64 sharded arithmetic matches the unsharded
model to rounding (1e-12 tells a bug from rounding); it has fused QKV and
gate/up projections (grouped splits, `_StridedShard`), tied weights and
depth replicas. The
resumed run must continue bit for bit like the run that was not interrupted.

One launch of 4 processes on [2,2,1] checks that ranks with different
weights, example inputs or (TESS_COMPILE_DEBUG=1) call inputs get a
ValueError on every rank, and that `full_state_dict()` honours the module's
timeout when a peer does not take part.
"""

from __future__ import annotations

import copy
import logging
import math
import pathlib
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import tess_compile
from tess_compile.core.layout import local_block
from tess_compile.runtime.dtensors import placements_of
from tess_compile.runtime.launch import run_local

VOCAB, HIDDEN, HEADS, SEQ = 16, 8, 2, 4
TOL = 1e-12  # float64: relative to the largest element
LR = 1e-2
# Per step: how its gradients are clipped (torch's function on parameters(), the module's
# method, the package function; the inf norm). Steps from RESUME_AT on run again after the resume.
CLIPS = ["torch", "method", "package", "inf"]
RESUME_AT = 2


class TiedAttentionLM(nn.Module):
    """Embedding tied to the output head, fused-QKV causal attention, fused gate/up SwiGLU MLP.

    No norm layer and no key bias: the key bias' gradient is exactly zero,
    and its rounding noise, which AdamW divides by eps, would move it by more
    than rounding.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.gate_up = nn.Linear(HIDDEN, 2 * 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        b, s, h = x.shape
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in self.qkv(x).split(h, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        gate, up = self.gate_up(x).split(4 * HIDDEN, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return self.head(x)


def make_case(q: int, d: int, seed: int = 21, batch: int | None = None):
    """Model (float64), token ids and targets, identical on every rank for the same arguments."""
    torch.manual_seed(seed)
    model = TiedAttentionLM().double()
    batch = batch or 2 * d * q
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    targets = torch.randint(0, VOCAB, (batch, SEQ))
    return model, ids, targets


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (inf on a shape mismatch or NaN)."""
    if actual is None or tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-300)
    return float("inf") if err != err else err


def error_text(call) -> str:
    """The ValueError message of `call()`, or a description of what happened instead."""
    try:
        call()
    except ValueError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001  (reported to the parent, which fails the test)
        return f"UNEXPECTED {type(err).__name__}: {err}"
    return "UNEXPECTED: no error"


class _Count(logging.Handler):
    """Counts torch's "sequential ... operations" warnings of DTensor redistribution."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += "sequential" in record.getMessage()


def _clip(kind: str, module, max_norm: float):
    """Clip `module`'s gradients the way `kind` names; the total norm as a plain tensor."""
    if kind == "torch":
        total = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, foreach=True)
        return total.full_tensor() if isinstance(total, DTensor) else total
    if kind == "method":
        return module.clip_grad_norm_(max_norm)
    if kind == "package":
        return tess_compile.clip_grad_norm_(module, max_norm)
    return module.clip_grad_norm_(max_norm, norm_type=math.inf)


def _reference_step(reference, opt, ids, targets, kind: str, max_norm: float):
    opt.zero_grad()
    loss = F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    norm_type = math.inf if kind == "inf" else 2.0
    total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    opt.step()
    return loss.detach(), total


def _sharded_step(sm, opt, ids, targets, kind: str, max_norm: float):
    opt.zero_grad()
    loss = F.cross_entropy(tess_compile.full_tensor(sm(ids)).flatten(0, 1), targets.flatten())
    loss.backward()
    total = _clip(kind, sm, max_norm)
    opt.step()
    return loss.detach(), total


def _full_weights(sm) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor() for name, p in sm.named_parameters()}


def _train_worker(rank, world_size, checkpoint_dir):
    torch.set_num_threads(1)
    warnings = _Count()
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(warnings)
    q, d = 2, 2
    model, ids, targets = make_case(q, d)
    reference = copy.deepcopy(model)
    sm = tess_compile.shard(model, q, d, example_inputs=(ids,), timeout=60)
    out = {"errors": {}, "problems": [], "totals": {}}
    errors, problems = out["errors"], out["problems"]

    # Parameters: DTensors placed by their layouts, holding this rank's blocks; the tie is one tensor.
    params = dict(sm.named_parameters())
    ref_params = dict(reference.named_parameters())
    if list(params) != list(ref_params):
        problems.append(f"parameter names {list(params)} != the model's {list(ref_params)}")
    if sm.head.weight is not sm.embed.weight:
        problems.append("the tied head.weight and embed.weight are two tensors")
    slots = {slot.name: slot for slot in sm.program.params}
    for name, param in params.items():
        slot = slots[name]
        if not isinstance(param, DTensor) or param.device_mesh is not sm.device_mesh:
            problems.append(f"{name} is a {type(param).__name__}, not a DTensor on the module's mesh")
            continue
        if tuple(param.placements) != placements_of(slot.layout) or param.shape != ref_params[name].shape:
            problems.append(f"{name}: placements {param.placements}, shape {list(param.shape)} for layout {slot.layout}")
        if not torch.equal(param.to_local(), local_block(ref_params[name].detach(), slot.layout, sm.mesh, rank)):
            problems.append(f"{name}: the local tensor is not this rank's block")
        if not torch.equal(param.full_tensor(), ref_params[name].detach()):
            problems.append(f"{name}: full_tensor() is not the model's tensor")
    out["strided"] = [name for name, p in params.items() if "_StridedShard" in str(p.placements)]

    # One forward and backward: gradients are DTensors of the parameters' placements holding
    # exactly this rank's local gradient (to_local's backward redistributes nothing).
    logits = sm(ids)
    full = tess_compile.full_tensor(logits)
    if not torch.equal(full, logits.full_tensor()):
        problems.append("tess_compile.full_tensor(logits) != logits.full_tensor()")
    errors["logits"] = rel_err(full, reference(ids))
    F.cross_entropy(full.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
    for name, param in params.items():
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.placements != param.placements:
            problems.append(f"{name}: gradient {type(grad).__name__} {getattr(grad, 'placements', None)}")
            continue
        errors[f"grad {name}"] = rel_err(grad.to_local(), local_block(ref_params[name].grad, slots[name].layout, sm.mesh, rank))
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in ref_params.values()])
    max_norm = 0.5 * unclipped.item()  # every step clips

    # Training: the first steps, then a DCP checkpoint of model and optimizer state.
    sm.zero_grad()
    reference.zero_grad()
    opt = torch.optim.AdamW(sm.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    losses = []
    for step, kind in enumerate(CLIPS):
        if step == RESUME_AT:
            state = {"model": get_model_state_dict(sm), "optim": tess_compile.for_dcp(get_optimizer_state_dict(sm, opt))}
            dcp.save(state, checkpoint_id=checkpoint_dir)
        loss, total = _sharded_step(sm, opt, ids, targets, kind, max_norm)
        loss_ref, total_ref = _reference_step(reference, opt_ref, ids, targets, kind, max_norm)
        if isinstance(total, DTensor) or total.shape != ():
            problems.append(f"step {step} ({kind}): the total norm is a {type(total).__name__} {list(total.shape)}")
        out["totals"][step] = (total.item(), total_ref.item())
        errors[f"step {step} loss"] = rel_err(loss, loss_ref)
        errors[f"step {step} total norm ({kind})"] = rel_err(total, total_ref)
        for name, value in _full_weights(sm).items():
            errors[f"step {step} weight {name}"] = rel_err(value, ref_params[name])
        losses.append(loss)
    final = _full_weights(sm)

    # Resume: the same program in a fresh module with other weights and a fresh optimizer,
    # loaded from the checkpoint, continues exactly as the run that was not interrupted.
    resumed = tess_compile.shard_program(sm.program, timeout=60)
    with torch.no_grad():
        for param in resumed.parameters():
            param.to_local().add_(1.0)
    opt_resumed = torch.optim.AdamW(resumed.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    model_state, optim_state = get_model_state_dict(resumed), get_optimizer_state_dict(resumed, opt_resumed)
    dcp.load({"model": model_state, "optim": tess_compile.for_dcp(optim_state)}, checkpoint_id=checkpoint_dir)
    set_model_state_dict(resumed, model_state)
    set_optimizer_state_dict(resumed, opt_resumed, optim_state)
    for step in range(RESUME_AT, len(CLIPS)):
        loss, _ = _sharded_step(resumed, opt_resumed, ids, targets, CLIPS[step], max_norm)
        if not torch.equal(loss, losses[step]):
            problems.append(f"resumed step {step}: loss {loss.item()!r} != {losses[step].item()!r} without the resume")
    for name, value in _full_weights(resumed).items():
        if not torch.equal(value, final[name]):
            problems.append(f"resumed {name} differs from the run without the resume by {(value - final[name]).abs().max().item():.3e}")
    if resumed.head.weight is not resumed.embed.weight:
        problems.append("the resumed module's tied weights are two tensors")
    out["sequential warnings"] = warnings.count
    return out


def _consistency_worker(rank, world_size, done_dir):
    """[2,2,1], TESS_COMPILE_DEBUG=1: mismatched ranks are refused on every rank; timeouts are told."""
    torch.set_num_threads(1)
    q, d = 2, 1
    out = {}
    model, ids, targets = make_case(q, d)
    if rank == 2:
        with torch.no_grad():
            model.qkv.weight[0, 0] += 1e-3
    out["weights"] = error_text(lambda: tess_compile.shard(model, q, d, example_inputs=(ids,), timeout=30))

    model, ids, targets = make_case(q, d)
    example = make_case(q, d, batch=4 * d * q)[1] if rank == 3 else ids
    out["example"] = error_text(lambda: tess_compile.shard(model, q, d, example_inputs=(example,), timeout=30))

    sm = tess_compile.shard(model, q, d, example_inputs=(ids,), timeout=3)
    out["same inputs"] = tuple(sm(ids).full_tensor().shape)
    other = torch.remainder(ids + 1, VOCAB) if rank == 1 else ids
    out["inputs"] = error_text(lambda: sm(other))

    # A peer that never gathers: the others fail within the module's timeout, with a message.
    done = pathlib.Path(done_dir)
    if rank == 1:
        start = time.monotonic()
        while time.monotonic() - start < 20 and len(list(done.glob("done-*"))) < world_size - 1:
            time.sleep(0.1)
        return out
    start = time.monotonic()
    try:
        sm.full_state_dict()
        out["timeout"] = None
    except RuntimeError as err:
        out["timeout"] = str(err)
    out["elapsed"] = time.monotonic() - start
    (done / f"done-{rank}").touch()
    return out


@pytest.mark.slow
def test_training_with_torch_tools_on_q2d2(tmp_path):
    results = run_local(_train_worker, 8, args=(str(tmp_path / "dcp"),), timeout_s=300, collective_timeout_s=120)
    for rank, res in enumerate(results):
        assert res["problems"] == [], f"rank {rank}:\n" + "\n".join(res["problems"])
        bad = {name: err for name, err in res["errors"].items() if not err <= TOL}
        assert not bad, f"rank {rank}: beyond {TOL}: {bad}"
        assert res["sequential warnings"] == 0, f"rank {rank}: torch warned of sequential collectives"
        assert res["totals"] == results[0]["totals"], f"rank {rank}: total norms differ from rank 0's"
    errors = results[0]["errors"]
    assert sum(name.startswith("grad ") for name in errors) == 8, sorted(errors)
    assert results[0]["strided"] == ["qkv.weight", "gate_up.weight", "gate_up.bias"], "the check needs grouped splits"
    for step, (total, unclipped) in results[0]["totals"].items():
        assert total > 0 and unclipped > 0, step


@pytest.mark.slow
def test_rank_consistency_and_timeouts_on_q2d1(tmp_path):
    results = run_local(
        _consistency_worker, 4, args=(str(tmp_path),), timeout_s=240, collective_timeout_s=60,
        env={"TESS_COMPILE_DEBUG": "1"},
    )
    for rank, res in enumerate(results):
        msg = res["weights"]
        for words in ("'qkv.weight' [24, 8]: rank(s) [2] differ from rank(s) [0, 1, 3]", "mesh [q=2, q=2, d=1]",
                      "torch.manual_seed", "load one checkpoint on every rank"):
            assert words in msg, f"rank {rank}: {words!r} not in {msg}"
        assert "UNEXPECTED" not in msg and "'proj.weight'" not in msg, f"rank {rank}: {msg}"
        msg = res["example"]
        for words in ("example positional input 0", "shape [4, 4] torch.int64 on rank(s) [0, 1, 2]",
                      "shape [8, 4] torch.int64 on rank(s) [3]", "same example_inputs"):
            assert words in msg, f"rank {rank}: {words!r} not in {msg}"
        assert "weights" not in msg, f"rank {rank}: {msg}"
        assert res["same inputs"] == (4, SEQ, VOCAB)
        msg = res["inputs"]
        for words in ("positional input 0 [4, 4]: rank(s) [1] differ from rank(s) [0, 2, 3]", "TESS_COMPILE_DEBUG=1",
                      "same batch on every rank"):
            assert words in msg, f"rank {rank}: {words!r} not in {msg}"
        if rank != 1:
            msg = res["timeout"]
            assert msg is not None, f"rank {rank}: full_state_dict finished although rank 1 never gathered"
            for words in ("tess gather of", f"failed on rank {rank}", "within 3s"):
                assert words in msg, f"rank {rank}: {words!r} not in {msg}"
            assert res["elapsed"] < 15, f"rank {rank} took {res['elapsed']:.1f} s: {msg}"
