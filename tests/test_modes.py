"""The parallel modes: 1-D (Megatron-LM), 2-D (Optimus), 2.5-D and 3-D (Tesseract).

Each mode is checked against the unsharded model (outputs, every gradient,
weights after AdamW steps), for its layouts, and for the exact collectives
it runs per phase, predicted from the graph and recorded at run time.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from conftest import assert_close_rel, assert_matches_model
from hf_models import build
from models import GPTBlock, LlamaBlock, TinyGPT, make_block

import tess_compile
from tess_compile.analysis.accounting import bytes_from_records, predict_bytes
from tess_compile.core.layout import Layout, Replicate, Shard
from tess_compile.core.mesh import Mesh

R = Replicate()
# (mode, q, d): meshes of every mode; 1-D runs p = q*q*d ranks on one axis.
MODE_MESHES = [("1d", 1, 2), ("1d", 2, 1), ("1d", 2, 2), ("2d", 2, 1), ("2d", 3, 1), ("3d", 2, 2), ("2.5d", 4, 2)]


def mode_id(mode: str, q: int, d: int) -> str:
    return f"{mode}-{Mesh(q, d, mode)}".replace(" ", "")


def block_for(kind: str, mesh: Mesh) -> tuple[torch.nn.Module, torch.Tensor]:
    """A block whose heads divide every axis of `mesh`, and a batch that splits over it."""
    parts = mesh.size("col")
    model = make_block(kind, hidden=4 * parts, heads=parts)
    x = torch.randn(2 * mesh.size("depth") * mesh.size("row"), 4, 4 * parts)
    return model, x


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("mode, q, d", MODE_MESHES, ids=[mode_id(*m) for m in MODE_MESHES])
def test_block_parity_and_bytes(kind, mode, q, d):
    """Output and every gradient equal the model's, and the bytes each rank sends per
    phase, predicted from the graph, equal the bytes the run recorded."""
    torch.manual_seed(5)
    mesh = Mesh(q, d, mode)
    model, x = block_for(kind, mesh)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode, strict=True, verify=True)
    assert sim.mesh == mesh
    assert_matches_model(sim, model, x)
    recorded = bytes_from_records(sim.comm.records)
    assert recorded == predict_bytes(sim.program)
    assert sum(recorded["forward"].values()) > 0 and sum(recorded["backward"].values()) > 0


def test_megatron_layouts_and_collectives():
    """1-D GPT block at p=4 without sequence parallelism: column-parallel QKV and fc (fused QKV keeps
    whole heads), row-parallel proj layers with partial outputs, two all-reduces a phase of [b, s, h]
    plus, in backward, one of the replicated vectors' gradients (one bucket)."""
    mesh = Mesh(2, 1, "1d")
    torch.manual_seed(0)
    model, x = block_for("gpt", mesh)
    sim = tess_compile.simulate(model, 2, 1, example_inputs=(x,), mode="1d", strict=True, token_split="none")
    layouts = {slot.name: slot.layout for slot in sim.program.slots if slot.role == "param"}
    assert layouts["qkv.weight"] == Layout(R, R, Shard(0, 3))
    assert layouts["qkv.bias"] == Layout(R, R, Shard(0, 3))
    assert layouts["mlp.fc.weight"] == Layout(R, R, Shard(0))
    assert layouts["proj.weight"] == Layout(R, R, Shard(1))
    assert layouts["mlp.proj.weight"] == Layout(R, R, Shard(1))
    for name in ("ln1.weight", "ln2.bias", "proj.bias", "mlp.proj.bias"):
        assert layouts[name] == Layout(R, R, R), name
    linears = [n for n in sim.program.graph.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 4, "a 1-D linear is one local product, no SUMMA steps"

    (sim(x) * torch.randn_like(x)).sum().backward()
    assert sim.comm.counts("forward") == {("all_reduce", "col"): 2}
    vectors = [n for n, p in model.named_parameters() if layouts[n] == Layout(R, R, R)]
    assert len(vectors) == 6
    assert sim.comm.counts("backward") == {("all_reduce", "col"): 2 + 1}
    activation = x.numel() * x.element_size()
    assert predict_bytes(sim.program)["forward"] == {("all_reduce", "col"): 2 * activation}


def test_tiny_gpt_1d_vocab_parallel():
    """Embeddings split by vocab over all p ranks, the head column-parallel over vocab;
    the lookup's partial sums are all-reduced once."""
    torch.manual_seed(2)
    model = TinyGPT(vocab=32, hidden=16, heads=4, layers=2, seq=8)
    ids = torch.randint(0, 32, (2, 8))
    sim = tess_compile.simulate(model, 2, 1, example_inputs=(ids,), mode="1d", strict=True, verify=True)
    layouts = {slot.name: slot.layout for slot in sim.program.slots if slot.role == "param"}
    assert layouts["tokens.weight"] == Layout(R, R, Shard(0))
    assert layouts["positions.weight"] == Layout(R, R, Shard(0))
    assert layouts["head.weight"] == Layout(R, R, Shard(0))
    assert sim.program.output_layouts[0] == Layout(R, R, Shard(2))
    assert_matches_model(sim, model, ids)
    assert predict_bytes(sim.program) == bytes_from_records(sim.comm.records)


@pytest.mark.parametrize("mode, q, d", [("1d", 2, 1), ("2d", 2, 1), ("2.5d", 2, 2)])
def test_adamw_steps_match(mode, q, d):
    """Five AdamW steps in float64 (see test_training.py for why): the gathered weights
    equal the model's, and ranks holding the same block hold the same bits."""
    torch.manual_seed(3)
    mesh = Mesh(q, d, mode)
    model, x = block_for("gpt", mesh)
    model = model.double()
    x = x.double()
    reference = copy.deepcopy(model)
    target = torch.randn_like(x)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode, strict=True)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt_sim = torch.optim.AdamW(sim.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        for opt, module in ((opt_ref, reference), (opt_sim, sim)):
            opt.zero_grad()
            (module(x) * target).sum().backward()
            opt.step()
    state = sim.full_state_dict()
    for name, value in reference.state_dict().items():
        assert not torch.equal(value, model.state_dict()[name]), f"{name} did not move: the test would miss a wrong update"
        assert_close_rel(state[name], value, name=f"{name} after 5 steps")
    for slot in sim.program.params:
        blocks: dict = {}
        for rank in range(mesh.num_ranks):
            key = tuple(
                mesh.coord(rank, axis) for axis in ("depth", "row", "col") if isinstance(slot.layout.on(axis), Shard)
            )
            blocks.setdefault(key, []).append(sim.rank_tensor(slot.name, rank))
        for copies in blocks.values():
            assert all(torch.equal(c, copies[0]) for c in copies), f"{slot.name}: replicas differ"


@pytest.mark.parametrize("name, q, d", [("gpt2", 2, 1), ("llama", 1, 2), ("bert", 1, 2)])
def test_hf_models_1d(name, q, d):
    """Hugging Face models in 1-D: logits, loss and every gradient."""
    model, kwargs = build(name, 2, 1)
    oracle = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF mask code's index ops run replicated
        sim = tess_compile.simulate(model, q, d, example_inputs=kwargs, mode="1d")
    out, expected = sim(**kwargs), oracle(**kwargs)
    assert_close_rel(out.logits, expected.logits, 1e-4, "logits")
    assert_close_rel(out.loss, expected.loss, 1e-4, "loss")
    out.loss.backward()
    expected.loss.backward()
    grads = sim.full_grads()
    largest = max(p.grad.abs().max().item() for p in oracle.parameters())
    for pname, param in oracle.named_parameters():
        err = (grads[pname] - param.grad).abs().max().item()
        assert err <= 1e-4 * max(param.grad.abs().max().item(), 1e-4 * largest), f"{name} grad {pname}: {err:.3e}"


def test_mode_2d_is_2_5d_at_depth_1():
    torch.manual_seed(4)
    model, x = LlamaBlock(8, 2), torch.randn(4, 4, 8)
    a = tess_compile.simulate(model, 2, 1, example_inputs=(x,), mode="2d")
    b = tess_compile.simulate(model, 2, 1, example_inputs=(x,))
    assert a.program.graph.code == b.program.graph.code
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize(
    "mode, q, d, text",
    [
        ("2d", 2, 2, "mode '2d' (Optimus) is the d=1 case"),
        ("3d", 2, 1, "mode '3d' is the d=q case"),
        ("4d", 2, 1, "mode '4d' is not one of"),
        ("2.5d", 2, 3, "d=3 > q=2"),
    ],
)
def test_bad_modes(mode, q, d, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        tess_compile.simulate(GPTBlock(8, 2), q, d, example_inputs=(torch.randn(4, 4, 8),), mode=mode)


def test_1d_heads_not_dividing_p():
    """A head count that p does not divide is refused with the sizes and the fix."""
    with pytest.raises(ValueError, match=r"not divisible by 8.*head count.*multiple of 8"):
        tess_compile.simulate(GPTBlock(16, 4), 2, 2, example_inputs=(torch.randn(2, 4, 16),), mode="1d")


def test_row_parallel_bias_is_added_once():
    """A row-parallel linear's bias is added on one rank of the partial sum: with p=4 a
    bias-only model (zero weights) gives the bias, not four times it."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    with torch.no_grad():
        model[1].weight.zero_()
    x = torch.randn(2, 8)
    sim = tess_compile.simulate(model, 2, 1, example_inputs=(x,), mode="1d", strict=True)
    assert sim.program.slots[3].layout == Layout(R, R, R)  # 1.bias
    placed = [n for n in sim.program.graph.graph.nodes if n.name.startswith("keep_first")]
    assert len(placed) == 1
    assert_close_rel(sim(x), model[1].bias.detach().expand(2, 8), name="bias-only output")


@pytest.mark.parametrize("mode, q, d, summa", [("1d", 1, 4, "broadcast"), ("2.5d", 2, 2, "gather")])
def test_torch_compile_backend_takes_mode_and_schedule(mode, q, d, summa):
    """torch.compile with the backend in another mode and schedule: output and gradients."""
    torch.manual_seed(7)
    model = GPTBlock(16, 4)
    x = torch.randn(4, 4, 16)
    compiled = torch.compile(model, backend=tess_compile.backend(q, d, mode=mode, summa=summa, simulate=True))
    reference = copy.deepcopy(model)
    out = compiled(x)
    assert_close_rel(out, reference(x), name="output")
    out.square().sum().backward()
    reference(x).square().sum().backward()
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close_rel(param.grad, ref.grad, name=f"grad {name}")
