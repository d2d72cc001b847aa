"""Data parallelism around the [q, q, d] mesh: `shard(..., mesh=)`, ZeRO with FSDP2, `simulate` of a spec with dp.

One launch of 8 gloo processes on the mesh `(dp, depth, row, col) = (2, 1, 2, 2)`
(data parallel 2 x [2,2,1]), TESS_COMPILE_DEBUG=1 (every call checks its inputs
within the tensor-parallel group: the two data-parallel groups pass
different batches). Every rank builds the same float64 model and the same
global batch; data-parallel group g feeds rows [4g, 4g+4). The unsharded
model trains on the whole batch with a mean loss beside it:

- `mesh=`: parameters and outputs are DTensors on the (depth, row, col)
  submesh, each rank's blocks those of its coordinates there; gradients
  (averaged over dp) equal the unsharded model's; after AdamW steps with
  torch's clipping the weights match to 1e-12 and are bit-identical on all 8
  ranks; a DCP checkpoint saved by both groups loads back;
- `zero=True` (FSDP2 over dp): the same training, the same weights, and per
  rank half the parameter, gradient and AdamW bytes;
- bad input: ValueErrors that name the mesh and the fix.

The model (from test_training_loop) has no key bias: its exactly-zero
gradient's rounding noise would be amplified by AdamW.

In one process: `simulate(spec=ParallelSpec(2, 2, dp=2))` (16 ranks) trains exactly like the
unsharded model on the whole batch; `simulate(dp=...)`, its old spelling, still works, with a
FutureWarning.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from test_training_loop import SEQ, VOCAB, TiedAttentionLM, error_text, rel_err
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tess_compile
from tess_compile.core.layout import local_block
from tess_compile.core.parallel_spec import ParallelSpec
from tess_compile.runtime.consistency import fingerprint
from tess_compile.runtime.dtensors import placements_of
from tess_compile.runtime.launch import run_local

TOL = 1e-12
LR = 1e-2
STEPS = 3
DP, Q, D = 2, 2, 1
GROUP_BATCH = 2 * D * Q


def make_case(seed: int = 5):
    """Model (float64), global ids and targets of DP groups, identical on every rank."""
    torch.manual_seed(seed)
    model = TiedAttentionLM().double()
    ids = torch.randint(0, VOCAB, (DP * GROUP_BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (DP * GROUP_BATCH, SEQ))
    return model, ids, targets


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(module, opt) -> dict[str, int]:
    """This rank's parameter, gradient and AdamW-state bytes."""
    params = list(module.parameters())
    return {
        "params": sum(_local(p).numel() * _local(p).element_size() for p in params),
        "grads": sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in params if p.grad is not None),
        "adamw": sum(_local(v).numel() * _local(v).element_size()
                     for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
    }


def _train(sm, reference, ids, targets, group_rows, errors, tag):
    """STEPS of AdamW with torch's clipping on both; weights compared after each. Returns bytes
    measured after the last backward (gradients present)."""
    opt = torch.optim.AdamW(sm.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    measured = {}
    for step in range(STEPS):
        loss = F.cross_entropy(tess_compile.full_tensor(sm(ids[group_rows])).flatten(0, 1), targets[group_rows].flatten())
        loss.backward()
        F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
        total = torch.nn.utils.clip_grad_norm_(sm.parameters(), 0.5, foreach=True)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        total_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        errors[f"{tag} step {step} total norm"] = rel_err(total, total_ref)
        opt.step()
        opt_ref.step()
        if step == STEPS - 1:
            measured = _bytes(sm, opt)
        opt.zero_grad()
        opt_ref.zero_grad()
        for name, value in sm.full_state_dict().items():
            errors[f"{tag} step {step} weight {name}"] = rel_err(value, reference.state_dict()[name])
    return measured, opt


def _dp_worker(rank, world_size, checkpoint_dir):
    torch.set_num_threads(1)
    out = {"problems": [], "errors": {}}
    problems, errors = out["problems"], out["errors"]
    root = init_device_mesh("cpu", (DP, D, Q, Q), mesh_dim_names=("dp", "depth", "row", "col"))
    group = root.get_local_rank("dp")
    rows = slice(group * GROUP_BATCH, (group + 1) * GROUP_BATCH)
    model, ids, targets = make_case()

    # Bad input, refused before compiling.
    flat = init_device_mesh("cpu", (DP, Q * Q * D), mesh_dim_names=("dp", "tp"))
    swapped = init_device_mesh("cpu", (DP, Q, D, Q), mesh_dim_names=("dp", "row", "depth", "col"))
    out["no dims"] = error_text(lambda: tess_compile.shard(model, Q, D, example_inputs=(ids[rows],), mesh=flat))
    out["order"] = error_text(lambda: tess_compile.shard(model, Q, D, example_inputs=(ids[rows],), mesh=swapped))
    out["sizes"] = error_text(lambda: tess_compile.shard(model, Q, 2, example_inputs=(ids[rows],), mesh=root))
    out["batch"] = error_text(lambda: tess_compile.shard(model, Q, D, example_inputs=(ids[:3],), mesh=root,
                                                         batch_split="depth_row"))
    out["not a mesh"] = error_text(lambda: tess_compile.shard(model, Q, D, example_inputs=(ids[rows],), mesh="dp"))
    out["zero without mesh"] = error_text(lambda: tess_compile.shard(model, Q, D, example_inputs=(ids[rows],), zero=True))

    # mesh=: every group its own batch; parameters and outputs on the (depth, row, col) submesh.
    reference = copy.deepcopy(model)
    sm = tess_compile.shard(model, Q, D, example_inputs=(ids[rows],), mesh=root, timeout=60)
    tp_rank = sm.world.rank
    out["tp rank"], out["tp mesh"] = tp_rank, tuple(sm.device_mesh.mesh_dim_names)
    if sm.device_mesh.get_coordinate() != root["depth", "row", "col"].get_coordinate():
        problems.append("the module's mesh is not the (depth, row, col) submesh of mesh=")
    slots = {s.name: s for s in sm.program.params}
    for name, param in sm.named_parameters():
        if param.device_mesh is not sm.device_mesh or tuple(param.placements) != placements_of(slots[name].layout):
            problems.append(f"{name}: placements {param.placements} on {param.device_mesh}")
        if not torch.equal(param.to_local(), local_block(reference.state_dict()[name], slots[name].layout, sm.mesh, tp_rank)):
            problems.append(f"{name}: the local tensor is not the block of tensor-parallel rank {tp_rank}")
    logits = sm(ids[rows])
    if not isinstance(logits, DTensor) or logits.device_mesh is not sm.device_mesh:
        problems.append(f"the output is a {type(logits).__name__}, not a DTensor on the tensor-parallel submesh")
    errors["logits"] = rel_err(tess_compile.full_tensor(logits), reference(ids[rows]))
    F.cross_entropy(tess_compile.full_tensor(logits).flatten(0, 1), targets[rows].flatten()).backward()
    F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
    for name, param in sm.named_parameters():  # averaged over dp: the whole batch's gradient
        errors[f"grad {name}"] = rel_err(param.grad.to_local(), local_block(dict(reference.named_parameters())[name].grad,
                                                                            slots[name].layout, sm.mesh, tp_rank))
    sm.zero_grad()
    reference.zero_grad()
    start = copy.deepcopy(reference)
    out["bytes"], opt = _train(sm, reference, ids, targets, rows, errors, "mesh=")
    final = sm.full_state_dict()
    out["fingerprints"] = {name: fingerprint(value) for name, value in final.items()}

    # DCP: both groups save the same blocks; a fresh module loads them back.
    dcp.save({"model": get_model_state_dict(sm), "optim": tess_compile.for_dcp(get_optimizer_state_dict(sm, opt))},
             checkpoint_id=checkpoint_dir)
    fresh = tess_compile.shard_program(sm.program, mesh=root, timeout=60)
    with torch.no_grad():
        for param in fresh.parameters():
            param.to_local().add_(1.0)
    model_state = get_model_state_dict(fresh)
    dcp.load({"model": model_state}, checkpoint_id=checkpoint_dir)
    set_model_state_dict(fresh, model_state)
    for name, value in fresh.full_state_dict().items():
        if not torch.equal(value, final[name]):
            problems.append(f"DCP: {name} loaded back differs by {(value - final[name]).abs().max().item():.3e}")

    # Weights that differ in one data-parallel group are refused on every rank.
    program = sm.program
    if rank == 5:
        tensors = dict(program.tensors, **{"qkv.weight": program.tensors["qkv.weight"] + 1e-3})
        program = dataclasses.replace(program, tensors=tensors)
    out["weights"] = error_text(lambda: tess_compile.shard_program(program, mesh=root, timeout=60))

    # ZeRO: FSDP2 over dp; the same training from the same start.
    zero = tess_compile.shard_program(sm.program, mesh=root, timeout=60, zero=True)
    out["zero class"] = type(zero).__name__
    out["zero placements"] = str(zero.get_parameter("qkv.weight").placements)
    out["zero bytes"], _ = _train(zero, start, ids, targets, rows, errors, "zero")
    out["zero state_dict"] = error_text(lambda: zero.state_dict())
    weights = zero.full_state_dict()
    zero.load_full_state_dict({name: value + 1 for name, value in weights.items()})
    for name, value in zero.full_state_dict().items():
        errors[f"zero reload {name}"] = rel_err(value, weights[name] + 1)
    return out


@pytest.mark.slow
def test_data_parallel_mesh_and_zero_over_gloo(tmp_path):
    results = run_local(_dp_worker, DP * Q * Q * D, args=(str(tmp_path / "dcp"),), timeout_s=600,
                        collective_timeout_s=300, env={"TESS_COMPILE_DEBUG": "1"})
    for rank, res in enumerate(results):
        assert res["problems"] == [], f"rank {rank}:\n" + "\n".join(res["problems"])
        bad = {name: err for name, err in res["errors"].items() if not err <= TOL}
        assert not bad, f"rank {rank}: beyond {TOL}: {bad}"
        assert res["fingerprints"] == results[0]["fingerprints"], f"rank {rank}: weights differ from rank 0's"
        assert res["tp rank"] == rank % (Q * Q * D) and res["tp mesh"] == ("depth", "row", "col")
        assert res["zero class"].startswith("FSDP"), res["zero class"]
        assert res["zero placements"].startswith("(_StridedShard(dim=0"), res["zero placements"]
        for kind in ("params", "grads", "adamw"):  # every parameter's local dim 0 splits in two
            assert res["bytes"][kind] > 0 and res["zero bytes"][kind] * DP == res["bytes"][kind], (rank, kind, res)
        expected = {
            "no dims": ["has no dim named 'depth', 'row', 'col'", "DeviceMesh of shape (2, 4) with dims ('dp', 'tp')",
                        "mesh_dim_names=(\"dp\", \"depth\", \"row\", \"col\")"],
            "order": ["out of order", "('dp', 'row', 'depth', 'col')"],
            "sizes": ["depth=1, row=2, col=2", "q=2, d=2", "need depth=2, row=2, col=2", "pass q=2, d=1"],
            "batch": ["batch_split='depth_row': the inputs' batch 3 is not divisible by the 2 ranks that split it",
                      "batch_split='auto'"],
            "not a mesh": ["not a torch DeviceMesh", "init_device_mesh"],
            "zero without mesh": ["zero=True", "no mesh was given", "or zero=False"],
            "weights": ["'qkv.weight' [24, 8]: rank(s) [5] differ from rank(s) [0, 1, 2, 3, 4, 6, 7]",
                        "torch.manual_seed"],
            "zero state_dict": ["zero=True module", "full_state_dict()", "zero=False"],
        }
        for key, words in expected.items():
            for word in words:
                assert word in res[key], f"rank {rank} {key}: {word!r} not in {res[key]}"
    errors = results[0]["errors"]
    assert sum(name.startswith("grad ") for name in errors) == 8, sorted(errors)
    print("bytes per rank, mesh=:", results[0]["bytes"], "zero=True:", results[0]["zero bytes"])


# ---------------------------------------------------------------------------
# In one process: a spec of dp = 2 at [2,2,2].
# ---------------------------------------------------------------------------


def test_simulate_dp2_q2d2_trains_like_the_unsharded_model():
    q, d, dp = 2, 2, 2
    torch.manual_seed(7)
    model = TiedAttentionLM().double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (dp * d * q, SEQ))
    targets = torch.randint(0, VOCAB, (dp * d * q, SEQ))
    sim = tess_compile.simulate(model, spec=ParallelSpec(q, d, dp=dp), example_inputs=(ids,))
    assert sim.num_groups == dp and sim.program.mesh.num_ranks == q * q * d
    # Group g computes on rows [g*b, (g+1)*b): its output is the model's on that slice.
    for g, replica in enumerate(sim.replicas):
        with torch.no_grad():
            assert rel_err(replica(ids[g * d * q:(g + 1) * d * q]), reference(ids[g * d * q:(g + 1) * d * q])) <= TOL
    opt = torch.optim.AdamW(sim.parameters(), lr=LR, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    errors = {}
    for step in range(STEPS):
        logits = sim(ids)
        errors[f"step {step} logits"] = rel_err(logits, reference(ids))
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()).backward()
        for name, grad in sim.full_grads().items():
            errors[f"step {step} grad {name}"] = rel_err(grad, dict(reference.named_parameters())[name].grad)
        total = sim.clip_grad_norm_(0.5)
        errors[f"step {step} total norm"] = rel_err(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        for name, value in sim.full_state_dict().items():
            errors[f"step {step} weight {name}"] = rel_err(value, reference.state_dict()[name])
    bad = {name: err for name, err in errors.items() if not err <= TOL}
    assert not bad, f"beyond {TOL}: {bad}"
    for a, b in zip(sim.replicas[0].parameters(), sim.replicas[1].parameters()):  # replicas stay equal
        assert torch.equal(a, b)
    assert torch.equal(sim.rank_tensor("qkv.weight", q * q * d + 3), sim.replicas[1].rank_tensor("qkv.weight", 3))


def test_simulate_dp_bad_input():
    torch.manual_seed(7)
    model = TiedAttentionLM().double()
    ids = torch.randint(0, VOCAB, (6, SEQ))
    with pytest.raises(ValueError) as err:
        tess_compile.simulate(model, spec=ParallelSpec(2, 2, dp=4), example_inputs=(ids,))
    for words in ("shape [6, 4]", "batch of 6, not divisible by dp = 4", "multiple of 4"):
        assert words in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"ParallelSpec\(dp=0\): dp is a count"):
        ParallelSpec(2, 2, dp=0)
    with pytest.warns(FutureWarning, match=r"simulate\(dp=...\) is deprecated: pass spec="), pytest.raises(
            ValueError, match="batch of 6, not divisible by dp = 4"):  # the old keyword, through the spec
        tess_compile.simulate(model, 2, 2, example_inputs=(ids,), dp=4)
