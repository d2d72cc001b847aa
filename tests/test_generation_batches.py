"""Sharded generation at any batch, and decode that moves activations, not weights.

A batch of one is served by programs of one sequence (a symbolic batch does not take 1: see
`core.dynamic`), its rows whole on every rank and its products weight-stationary; other batches
that d*q does not divide stay whole over row. The oracle is the unsharded model in float64: the
same tokens, each step's logits to 1e-12. A module compiled for serving (`batch_split="depth"`)
holds its weights as the decode step multiplies them, and hands its collectives fewer bytes per
token at [2,2,2] than Megatron-LM's layout does at p=8 (the runtime's records)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import counting_captures
from test_generation import VOCAB, gpt2, worst_error
from transformers import LlamaConfig, LlamaForCausalLM

import tess_compile


def both(sim, model, prompt, **kwargs):
    torch.manual_seed(5)
    out = sim.generate(prompt, return_dict_in_generate=True, output_logits=True, **kwargs)
    torch.manual_seed(5)
    return out, model.generate(prompt, **kwargs)


_ONE = ((1, {}, 2), (1, {"do_sample": True, "top_k": 8}, 0))  # the programs of one sequence once
_THREE = ((3, {}, 2),)  # then those of three sequences (whole over row)


@pytest.mark.parametrize(("mode", "runs"), [("2.5d", _ONE), pytest.param("2.5d", _THREE, marks=pytest.mark.slow),
                                            pytest.param("1d", _ONE + _THREE, marks=pytest.mark.slow)],
                         ids=["2.5d-one", "2.5d-three", "1d"])
def test_a_batch_of_one_and_batches_that_do_not_split(mode, runs, request):
    if mode == "2.5d":  # compiled for the generation tests once (conftest.py)
        model, sim, _ = request.getfixturevalue("gpt2_generating")
    else:
        model = gpt2()
        example = {"input_ids": torch.randint(0, VOCAB, (8, 5))}
        sim = tess_compile.simulate(copy.deepcopy(model), 2, 1, example_inputs=example, dynamic=True, mode=mode)
    # (batch, settings, captures)
    for batch, settings, compiles in runs:
        prompt = torch.randint(0, VOCAB, (batch, 4), generator=torch.Generator().manual_seed(batch))
        with counting_captures() as captures:
            out, expected = both(sim, model, prompt, max_new_tokens=6, **settings)
        assert torch.equal(out.sequences, expected), (batch, settings)
        if not settings.get("do_sample"):
            assert worst_error(model, out, 4) < 1e-12
        assert len(captures) == compiles
    batches = {batch for batch, _, _ in runs}
    assert 1 not in batches or "one" in sim.generation.programs
    assert 3 not in batches or mode == "1d" or "none" in sim.generation.programs  # 3: whole over depth and row


def llama(hidden: int = 64) -> LlamaForCausalLM:
    """The issue's model: grouped-query attention and a vocabulary that 8 does not divide."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=250, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=None)
    return LlamaForCausalLM(config).double().eval()


def decode_bytes_per_token(sim, prompt: torch.Tensor, new: int = 6) -> float:
    """Bytes rank 0 hands its collectives per generated token in decode steps (a prefill's subtracted)."""
    sim.comm.records.clear()
    sim.generate(prompt, max_new_tokens=1)
    prefill = sum(record.num_bytes for record in sim.comm.records)
    sim.comm.records.clear()
    sim.generate(prompt, max_new_tokens=new)
    return (sum(record.num_bytes for record in sim.comm.records) - prefill) / (new - 1) / prompt.shape[0]


@pytest.mark.slow  # two modules' generation programs (about 20 s); the fast tier's batch-one case covers the feature
def test_decode_moves_no_more_bytes_at_2_2_2_than_1d_at_8():
    model = llama()
    prompt = torch.randint(0, 250, (4, 5), generator=torch.Generator().manual_seed(0))
    expected = model.generate(prompt, max_new_tokens=6)
    example = {"input_ids": torch.randint(0, 250, (8, 5))}
    moved, sims = {}, {}
    for mode, split in (("2.5d", "depth"), ("1d", "auto")):
        sims[mode] = sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=example, dynamic=True,
                                                 mode=mode, batch_split=split)
        assert torch.equal(sim.generate(prompt, max_new_tokens=6), expected)
        moved[mode] = decode_bytes_per_token(sim, prompt)
    assert moved["2.5d"] <= 0.6 * moved["1d"], moved  # 2,946 against 4,992 bytes a token
    # one prompt on the module whose batch splits over depth: the programs of one sequence
    assert torch.equal(sims["2.5d"].generate(prompt[:1], max_new_tokens=3), expected[:1, :8])
