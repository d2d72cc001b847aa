"""Activations fully distributed: what autograd saves for backward, per rank and in
total over the ranks, against the unsharded model (DESIGN.md section 3, "Memory").

Saved bytes are measured as a user would: `saved_tensors_hooks` over one forward,
each storage counted once, parameters' storages left out. In the simulator the
hooks see every rank, so the measurement is the total over ranks. The predicted
bytes (`cost_model.activation_bytes`, from one rank's per-rank graph) equal the
measured total divided by p.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_matches_model
from models import GPTStack
from torch import nn

import tess_compile
from tess_compile.analysis.accounting import bytes_from_records, predict_bytes, saved_bytes
from tess_compile.analysis.memory import activation_bytes

HIDDEN, HEADS, LAYERS, BATCH, SEQ = 32, 8, 2, 16, 8
# (q, d, mode) of the issue: 2.5-D [2,2,2], 2-D [4,4,1], 2.5-D [4,4,2].
MESHES = [(2, 2, "2.5d"), (4, 1, "2d"), (4, 2, "2.5d")]
BOUND = 1.25  # total over ranks / unsharded


def measure(model: nn.Module, q: int, d: int, mode: str, **options) -> tuple[float, int, int]:
    """(total over ranks / unsharded, measured bytes per rank, predicted bytes per rank)."""
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    unsharded = saved_bytes(lambda: model(x), model.parameters())
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), mode=mode, **options)
    total = saved_bytes(lambda: sim(x), sim.parameters())
    return total / unsharded, total // sim.mesh.num_ranks, activation_bytes(sim.program)


@pytest.mark.parametrize("q, d, mode", MESHES, ids=[f"{m}-q{q}d{d}" for q, d, m in MESHES])
@pytest.mark.parametrize("checkpoint", [None, "non-reentrant"])
def test_saved_bytes_are_distributed(q, d, mode, checkpoint):
    """The default schedule keeps no fetched block: the total over ranks is at most 1.25
    times the unsharded model's, with the model's own checkpointed blocks too."""
    ratio, per_rank, predicted = measure(GPTStack(HIDDEN, HEADS, LAYERS, checkpoint), q, d, mode)
    assert ratio <= BOUND, f"saved bytes over ranks are {ratio:.2f} x the unsharded model's"
    assert predicted == per_rank


def test_compiler_blocks_checkpoint_matches_the_model_s_own():
    """recompute="blocks" on a plain stack saves what the model's own checkpoint calls save."""
    own = measure(GPTStack(HIDDEN, HEADS, LAYERS, "non-reentrant"), 2, 2, "2.5d")
    compiled = measure(GPTStack(HIDDEN, HEADS, LAYERS), 2, 2, "2.5d", recompute="blocks")
    assert compiled[1] == own[1] == compiled[2]


def test_keeping_blocks_keeps_q_blocks_per_product():
    lean = measure(GPTStack(HIDDEN, HEADS, LAYERS), 2, 2, "2.5d")
    keeping = measure(GPTStack(HIDDEN, HEADS, LAYERS), 2, 2, "2.5d", keep_blocks=True)
    assert keeping[0] > 2 * lean[0] and keeping[1] == keeping[2]


class PointwiseChain(nn.Module):
    """A linear followed by an unfused chain of pointwise ops whose intermediates autograd saves."""

    def __init__(self, hidden: int):
        super().__init__()
        self.inner = nn.Linear(hidden, hidden)
        self.outer = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.inner(x)
        h = torch.tanh(h) * torch.sigmoid(h) + h * h
        return self.outer(torch.exp(-h) * h)


def test_selective_recomputes_only_where_it_frees_memory():
    """A pointwise chain's saved intermediates are recomputed; the GPT stack, whose products
    and norms keep only what they need, keeps every run as it is."""
    chain_none = measure(PointwiseChain(HIDDEN), 2, 2, "2.5d")
    chain_selective = measure(PointwiseChain(HIDDEN), 2, 2, "2.5d", recompute="selective")
    assert chain_selective[1] < chain_none[1] and chain_selective[1] == chain_selective[2]
    for q, d, mode in ((2, 2, "2.5d"), (1, 4, "1d"), (1, 1, "2.5d")):
        stack_none = measure(GPTStack(HIDDEN, HEADS, LAYERS), q, d, mode)
        stack_selective = measure(GPTStack(HIDDEN, HEADS, LAYERS), q, d, mode, recompute="selective")
        assert stack_selective[2] <= stack_none[2], (mode, q, d)


# (label, model checkpoint, compiler checkpoint)
RECOMPUTE_CASES = [
    ("model-non-reentrant", "non-reentrant", "none"),
    ("model-reentrant", "reentrant", "none"),
    ("blocks", None, "blocks"),
    ("selective-chain", None, "selective"),
]


@pytest.mark.parametrize("label, model_checkpoint, checkpoint", RECOMPUTE_CASES, ids=[c[0] for c in RECOMPUTE_CASES])
@pytest.mark.parametrize("q, d", [(2, 2), (2, 1)], ids=["q2d2", "q2d1"])
def test_recomputed_regions_are_exact(label, model_checkpoint, checkpoint, q, d):
    """float64: output and every gradient within 1e-12; the recomputed collectives are
    recorded in backward and equal the predicted bytes. The input requires grad: with
    reentrant checkpointing torch gives the blocks' parameters no gradient otherwise."""
    torch.manual_seed(3)
    if label == "selective-chain":
        model = PointwiseChain(HIDDEN).double()
    else:
        model = GPTStack(HIDDEN, HEADS, LAYERS, model_checkpoint).double()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    sim = tess_compile.simulate(model, q, d, example_inputs=(x,), recompute=checkpoint, verify=True)
    regions = {n.meta["recompute"] for n in sim.program.graph.graph.nodes if "recompute" in n.meta}
    assert regions, "no region was marked"
    assert_matches_model(sim, model, x, rtol=1e-12)
    assert bytes_from_records(sim.comm.records) == predict_bytes(sim.program, inputs_require_grad=True)


def test_recomputed_blocks_re_issue_their_collectives():
    """A checkpointed block runs its forward collectives again in backward."""
    model = GPTStack(HIDDEN, HEADS, LAYERS, "non-reentrant")
    x = torch.randn(BATCH, SEQ, HIDDEN)
    plain = tess_compile.simulate(GPTStack(HIDDEN, HEADS, LAYERS), 2, 2, example_inputs=(x,))
    checkpointed = tess_compile.simulate(model, 2, 2, example_inputs=(x,))
    for sim in (plain, checkpointed):
        sim(x).sum().backward()
    forward = plain.comm.counts("forward")
    extra = {key: checkpointed.comm.counts("backward").get(key, 0) - plain.comm.counts("backward").get(key, 0)
             for key in checkpointed.comm.counts("backward")}
    blocks_only = {key: count for key, count in forward.items()}
    # every collective of both blocks again; the final norm (one all-gather) is not checkpointed
    blocks_only[("all_gather", "col")] -= 1
    assert {k: v for k, v in extra.items() if v} == blocks_only


def test_unknown_recompute_option():
    with pytest.raises(ValueError, match="recompute='all' is not a recompute option: use one of 'none', 'blocks', 'selective'"):
        tess_compile.simulate(GPTStack(8, 2, 1), 2, 1, example_inputs=(torch.randn(2, 4, 8),), recompute="all")


def test_hf_gpt2_predicted_saved_bytes_match_measured():
    """The planner's saved-bytes figure (predict_memory) equals the measured bytes per rank
    of Hugging Face GPT-2 (within 10%, the issue's bound; exact here)."""
    from hf_models import build

    from tess_compile.analysis.memory import predict_memory

    model, kwargs = build("gpt2", 2, 2, torch.float32)
    sim = tess_compile.simulate(model, 2, 2, example_inputs=kwargs)
    measured = saved_bytes(lambda: sim(**kwargs), sim.parameters()) / sim.mesh.num_ranks
    predicted = predict_memory(sim.program).activations
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


class _LlamaLogits(nn.Module):
    """Hugging Face Llama, `layers` layers, returning its logits: a vocab-split embedding starts the
    residual stream as partial sums over the tensor-parallel ranks."""

    def __init__(self, layers: int, hidden: int = HIDDEN):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.lm = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False))

    def forward(self, ids):
        return self.lm(input_ids=ids, use_cache=False).logits


def test_sequence_parallel_block_saves_its_token_block():
    """1-D p=4 with the tokens split and every block recomputed: the residual stream enters each block
    (the input its checkpoint saves) as the token block `[b, s/p, h]` (Megatron-LM's sequence
    parallelism with full recompute), not as the whole pending sum `[b, s, h]` of the TP ranks."""
    from tess_compile.core.fake_run import fake_run
    from tess_compile.ops.recompute_region import RecomputeRegion

    batch, seq = 2, 16
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))
    program = tess_compile.simulate(_LlamaLogits(2), 2, 1, example_inputs=(ids,), mode="1d", recompute="blocks").program
    graph = program.runnable
    values = fake_run(graph, program.mesh)
    calls = [n for n in graph.graph.nodes if n.op == "call_module" and isinstance(graph.get_submodule(n.target),
                                                                                    RecomputeRegion)]
    streams = [[tuple(values[a].shape) for a in call.args if values[a].dim() == 3 and values[a].shape[-1] == HIDDEN]
               for call in calls]
    assert streams == [[(batch, seq // 4, HIDDEN)]] * 2


SEQUENCE_PARALLEL_CASES = [(2, 1, "1d", 2), (2, 2, "2.5d", 1), (2, 2, "2.5d", 8)]


@pytest.mark.parametrize("q, d, mode, batch", [
    SEQUENCE_PARALLEL_CASES[0], *(pytest.param(*case, marks=pytest.mark.slow) for case in SEQUENCE_PARALLEL_CASES[1:])],
    ids=["1d-p4-tokens", "q2d2-tokens", "q2d2-batch"])
def test_recomputed_llama_blocks_are_exact(q, d, mode, batch):
    """float64 (the model's float32 casts kept float64): output and every gradient of a recomputed
    Llama, the tokens split (1-D p=4 and [2,2,2] at a batch of one) or the batch ([2,2,2])."""
    import copy

    from tess_compile.keep_float64 import keeping_float64

    model = _LlamaLogits(2).double()
    oracle = copy.deepcopy(model)
    ids = torch.randint(0, 64, (batch, 16), generator=torch.Generator().manual_seed(1))
    with keeping_float64(model, oracle):
        sim = tess_compile.simulate(model, q, d, example_inputs=(ids,), mode=mode, recompute="blocks", verify=True)
        assert_matches_model(sim, oracle, ids, rtol=1e-12)


def _recompute_worker(rank, world_size, q, d):
    """float64 over gloo: the model's own checkpoint calls (reentrant) and checkpoint="blocks"
    give the oracle's output and gradients; recorded bytes equal predicted ones."""
    import copy

    from tess_compile.core.layout import local_block

    torch.set_num_threads(1)
    out = {}
    for label, model_checkpoint, checkpoint in (("reentrant", "reentrant", "none"), ("blocks", None, "blocks")):
        torch.manual_seed(5)
        model = GPTStack(HIDDEN, HEADS, LAYERS, model_checkpoint).double()
        reference = copy.deepcopy(model)
        x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
        sharded = tess_compile.shard(model, q, d, example_inputs=(x,), recompute=checkpoint, timeout=60)
        got, expected = sharded(x).full_tensor(), reference(x)
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=expected.dtype)
        (got * target).sum().backward()
        (expected * target).sum().backward()
        errors = [(got - expected).abs().max().item() / expected.abs().max().item()]
        for slot in sharded.program.params:
            grad = dict(sharded.named_parameters())[slot.name].grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            oracle = local_block(dict(reference.named_parameters())[slot.name].grad, slot.layout, sharded.mesh, rank)
            errors.append((grad - oracle).abs().max().item() / oracle.abs().max().clamp_min(1e-30).item())
        exact_bytes = bytes_from_records(sharded.comm.records) == predict_bytes(sharded.program, inputs_require_grad=True)
        out[label] = (max(errors), exact_bytes)
    return out


@pytest.mark.slow
def test_recomputed_regions_over_gloo():
    from tess_compile.runtime.launch import run_local

    for result in run_local(_recompute_worker, 8, args=(2, 2), timeout_s=300):
        for label, (error, exact_bytes) in result.items():
            assert error <= 1e-12, f"{label}: relative error {error:.3e}"
            assert exact_bytes, f"{label}: recorded bytes differ from the predicted ones"
