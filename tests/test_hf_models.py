"""Hugging Face models through tess-compile: GPT-2, Llama, BERT and ViT.

The models come from small configs with random weights (`hf_models.build`:
nothing is downloaded, dropout probabilities 0); inputs are keyword dicts,
and the simulated / sharded module returns the model's own output type.

1. Simulation parity on [q, q, d] = (2, 2) (the fast tier), (2, 1), (3, 1):
   logits and loss within 1e-4 relative of the unsharded model, and every
   parameter's full gradient after `loss.backward()`.
2. GPT-2 (tied embeddings) trains 20 AdamW steps at (2, 2) with the
   unsharded model's per-step loss; the tied weights stay one tensor on
   every rank and `full_state_dict()` matches the model's.
3. Real gloo processes at (2, 2) (8 processes, one launch): GPT-2 and Llama
   logits, loss and every rank's local gradients.
4. Which ops run replicated (no sharding rule) in each model, printed by its
   parity compile at (2, 2) (`pytest -s`); the heavy ops must never be among them, and
   GPT-2 (its mask construction included) runs none.

Precision. Parity (1, 3) runs in float32, the dtype these models are used
in. Some gradients are exactly zero in exact arithmetic (the key
projection's bias: softmax is shift-invariant, so adding a constant to every
key changes nothing), and in float32 they are pure rounding noise (measured:
below 1e-10 of the model's largest gradient). So each gradient is compared
with a scale of its own largest element, floored at `GRAD_FLOOR` (1e-4)
times the largest gradient of the whole model: `|a - e| <= rtol * max(max|e|,
GRAD_FLOOR * max over all params |grad|) + rtol * |e|`. Every gradient that is
not noise is at least 2e-4 of the global maximum in these models, so it is
checked against its own scale; the noise is bounded at 1e-8 of the global
maximum. Training (2) runs in float64, because AdamW divides the key bias's
noise gradient by sqrt(v) + eps and turns it into steps of order lr whose
sign depends on the summation order (see tests/test_training.py); in
float64 that noise stays far below eps.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from conftest import assert_close_rel
from hf_models import MODEL_NAMES, build
from models import mesh_id
from torch.distributed.tensor import DTensor

import tess_compile
from tess_compile.core.layout import local_block
from tess_compile.runtime.launch import run_local

RTOL = 1e-4
GRAD_FLOOR = 1e-4  # a gradient's scale is at least this fraction of the model's largest gradient
PARITY_MESHES = [(2, 1), (2, 2), (3, 1)]
TRAIN_STEPS = 20
HEAVY_OPS = ["aten.linear", "aten.addmm", "aten.scaled_dot_product_attention", "aten.layer_norm", "aten.embedding"]


def grad_error(actual, expected: torch.Tensor, global_max: float) -> float:
    """How far `actual` is from `expected`, in units of the allowed error (<= 1 passes; inf for None,
    a shape or dtype mismatch, NaN). The allowed error is as in the module docstring."""
    if actual is None or tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
        return float("inf")
    a, e = actual.detach().double(), expected.detach().double()
    scale = max(e.abs().max().item() if e.numel() else 0.0, GRAD_FLOOR * global_max, 1e-30)
    ratio = ((a - e).abs() / (RTOL * scale + RTOL * e.abs())).max().item() if e.numel() else 0.0
    return float("inf") if ratio != ratio else ratio


def max_grad(model: torch.nn.Module) -> float:
    return max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)


def simulate_quietly(model, q, d, kwargs):
    """`tess_compile.simulate` and the "runs replicated" messages it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim = tess_compile.simulate(model, q, d, example_inputs=kwargs)
    return sim, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


# ---------------------------------------------------------------------------
# 1. Simulation parity: outputs and every gradient
# ---------------------------------------------------------------------------

# The fast tier: each model on [2, 2, 2]; the other meshes in the slow tier.
PARITY_CASES = [
    pytest.param(name, q, d, id=f"{name}-{mesh_id(q, d)}", marks=() if (q, d) == (2, 2) else (pytest.mark.slow,))
    for name in MODEL_NAMES for q, d in PARITY_MESHES
]


@pytest.mark.parametrize("name, q, d", PARITY_CASES)
def test_simulated_parity(name, q, d):
    """Logits, loss and every full gradient of the simulated model equal the model's
    (float32; gradients with the floored scale of the module docstring)."""
    model, kwargs = build(name, q, d)
    oracle = copy.deepcopy(model)
    sim, messages = simulate_quietly(model, q, d, kwargs)
    if (q, d) == (2, 2):
        check_replicated_ops(name, messages)

    out = sim(**kwargs)
    expected = oracle(**kwargs)
    assert type(out) is type(expected), f"output type {type(out).__name__} != {type(expected).__name__}"
    assert_close_rel(out.logits, expected.logits, rtol=RTOL, name=f"{name} logits")
    assert out.loss.dim() == 0
    assert_close_rel(out.loss, expected.loss, rtol=RTOL, name=f"{name} loss")

    out.loss.backward()
    expected.loss.backward()
    grads = sim.full_grads()
    names = [n for n, _ in oracle.named_parameters()]
    assert list(grads) == names, f"full_grads() keys {list(grads)} != named_parameters {names}"
    global_max = max_grad(oracle)
    assert global_max > 0
    bad = {}
    for pname, param in oracle.named_parameters():
        assert grads[pname] is not None, f"{name}: gradient of {pname} is None"
        err = grad_error(grads[pname], param.grad, global_max)
        if not err <= 1:
            bad[pname] = (err, (grads[pname] - param.grad).abs().max().item(), param.grad.abs().max().item())
    assert not bad, (
        f"{name} {mesh_id(q, d)}: gradients beyond tolerance "
        f"(name: (error / allowed, max abs err, max |grad|); global max |grad| {global_max:.3e}): {bad}"
    )


# ---------------------------------------------------------------------------
# 2. GPT-2 training: tied weights, per-step loss, state dict
# ---------------------------------------------------------------------------


def test_gpt2_adamw_training_tied():
    """20 AdamW steps (lr 1e-3) at (2, 2), float64 (see the module docstring)."""
    q, d = 2, 2
    model, kwargs = build("gpt2", q, d, dtype=torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight, "the config should tie the embeddings"
    oracle = copy.deepcopy(model)
    initial = copy.deepcopy(oracle.state_dict())
    sim, _ = simulate_quietly(model, q, d, kwargs)

    def check_tied(when):
        for rank in range(sim.mesh.num_ranks):
            assert sim.rank_tensor("lm_head.weight", rank) is sim.rank_tensor("transformer.wte.weight", rank), (
                f"{when}: lm_head.weight and transformer.wte.weight are different tensors on rank {rank}"
            )

    check_tied("before training")
    opt = torch.optim.AdamW(sim.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(oracle.parameters(), lr=1e-3)
    losses = []
    for step in range(TRAIN_STEPS):
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = sim(**kwargs).loss
        loss_ref = oracle(**kwargs).loss
        assert_close_rel(loss.detach(), loss_ref.detach(), rtol=RTOL, name=f"loss at step {step}")
        losses.append(loss_ref.item())
        loss.backward()
        loss_ref.backward()
        opt.step()
        opt_ref.step()
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    check_tied("after training")

    state = sim.full_state_dict()
    reference = oracle.state_dict()
    assert list(state) == list(reference), f"full_state_dict keys {list(state)} != {list(reference)}"
    for key, value in reference.items():
        assert not torch.equal(value, initial[key]), f"{key} did not move in {TRAIN_STEPS} steps: the check would be blind"
        assert_close_rel(state[key], value, rtol=RTOL, name=f"state {key}")
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


# ---------------------------------------------------------------------------
# 3. Real gloo processes at (2, 2)
# ---------------------------------------------------------------------------

DIST_MODELS = ["gpt2", "llama"]


def _rel(actual, expected) -> float:
    if actual is None or tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-12)
    return float("inf") if err != err else err


def _dist_worker(rank, world_size, q, d):
    """Forward and backward of GPT-2 and Llama on this rank; errors (in units of the allowed error
    for gradients, relative for logits and loss) and problems go back to the parent."""
    torch.set_num_threads(1)
    out = {"errors": {}, "problems": []}
    for label in DIST_MODELS:
        errors = out["errors"][label] = {}
        model, kwargs = build(label, q, d)
        oracle = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sm = tess_compile.shard(model, q, d, example_inputs=kwargs, timeout=120)
        result = sm(**kwargs)
        expected = oracle(**kwargs)
        if not isinstance(result.logits, DTensor):
            out["problems"].append(f"{label}: logits are a {type(result.logits).__name__}, not a DTensor")
            continue
        if isinstance(result.loss, DTensor) or not isinstance(result.loss, torch.Tensor):
            out["problems"].append(f"{label}: loss is a {type(result.loss).__name__}, not a plain tensor")
            continue
        errors["logits"] = _rel(result.logits.full_tensor(), expected.logits)
        errors["loss"] = _rel(result.loss, expected.loss)
        result.loss.backward()
        expected.loss.backward()

        params = dict(sm.named_parameters())
        oracle_params = dict(oracle.named_parameters())
        global_max = max_grad(oracle)
        names = [slot.name for slot in sm.program.params]
        if names != list(oracle_params):
            out["problems"].append(f"{label}: program.params {names} != named_parameters {list(oracle_params)}")
        for slot in sm.program.params:
            grad = params[slot.name].grad
            if grad is None:
                out["problems"].append(f"{label}: gradient of {slot.name} is None on rank {rank}")
                continue
            block = local_block(oracle_params[slot.name].grad, slot.layout, sm.mesh, rank)
            errors[f"grad {slot.name}"] = grad_error(grad.to_local(), block, global_max)  # a DTensor's shard
    return out


@pytest.mark.slow
def test_gloo_gpt2_and_llama_q2d2():
    """8 gloo processes at (2, 2); float32, gradients as in the module docstring."""
    q, d = 2, 2
    results = run_local(_dist_worker, q * q * d, args=(q, d), timeout_s=300, collective_timeout_s=120)
    assert len(results) == q * q * d
    for rank, res in enumerate(results):
        assert res["problems"] == [], f"rank {rank}:\n" + "\n".join(res["problems"])
        for label in DIST_MODELS:
            errors = res["errors"][label]
            assert any(k.startswith("grad ") for k in errors), f"rank {rank} {label}: no gradient was checked"
            bad = {k: v for k, v in errors.items() if not (v <= RTOL if k in ("logits", "loss") else v <= 1)}
            assert not bad, (
                f"rank {rank} {label}: beyond tolerance (logits/loss: relative error; "
                f"grads: error / allowed): {bad}"
            )


# ---------------------------------------------------------------------------
# 4. Ops that run replicated
# ---------------------------------------------------------------------------


REPLICATED_LINE = re.compile(r"^  (\S+) x(\d+) at (.*): gathers (\d+) bytes a rank$", re.M)


def check_replicated_ops(name: str, messages: list[str]) -> None:
    """Print which ops of model `name` have no sharding rule (`pytest -s`), from the messages of its compile;
    the heavy ops must all be sharded, and GPT-2 runs none replicated (its mask construction has rules too).

    The messages are collected with `warnings.catch_warnings(record=True)` rather than
    `pytest.warns`, which would fail once a model has no replicated op left.
    """
    lines = [m for message in messages if "no sharding rule" in message for m in REPLICATED_LINE.findall(message)]
    ops = [(f"{op} ({where.rsplit('/', 1)[-1]})", int(count)) for op, count, where, _ in lines]
    print(f"\n{name}: {sum(count for _, count in ops)} replicated op(s): "
          + (", ".join(f"{op} x{n}" for op, n in ops) or "none"))
    heavy = [op for op, _ in ops if any(op.split()[0] == h or op.startswith(h + ".") for h in HEAVY_OPS)]
    assert not heavy, f"{name}: heavy ops run replicated: {heavy}"
    assert name != "gpt2" or not ops, messages
