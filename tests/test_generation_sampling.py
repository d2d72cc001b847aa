"""Sharded generation beyond greedy: sampling, logits processors, stopping criteria, streamers,
num_return_sequences, padded prompts and the returned scores.

The oracle is the unsharded model's own `generate` in float64: under one `torch.manual_seed`
the same tokens (transformers' processors and `torch.multinomial` run on the gathered logits,
which equal the unsharded model's). Each sharded model is compiled once (GPT-2's for every generation
test of a worker: conftest.py's `gpt2_generating`), its two programs (prefill and decode) serving every
call: the captures are counted. The run
over 8 gloo processes and Llama's padded prompts (its fixture compiles for 7 s) are in the slow tier.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import counting_captures
from test_generation import VOCAB, compiled, gpt2, prompts
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import tess_compile
from tess_compile.runtime.launch import run_local

NEW = 4
SAMPLING = [{"temperature": 0.7, "top_k": 8}, {"top_p": 0.8, "min_p": 0.05}, {"typical_p": 0.9, "temperature": 1.3}]


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).double().eval()


def both(sim, model, seed: int = 3, **kwargs):
    """The tokens of the sharded and of the unsharded model, each under `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    sharded = sim.generate(**kwargs)
    torch.manual_seed(seed)
    return sharded, model.generate(**kwargs)


@pytest.fixture
def gpt2_sim(gpt2_generating):
    model, sim, first = gpt2_generating  # compiled for the generation tests once (conftest.py)
    return model, (sim, first)


@pytest.fixture(scope="module")
def llama_sim():
    model = llama()
    return model, compiled(model, 2, 2)


def test_sampling_equals_the_unsharded_model(gpt2_sim):
    model, (sim, _) = gpt2_sim
    for settings in SAMPLING:
        sharded, expected = both(sim, model, input_ids=prompts(), max_new_tokens=NEW, do_sample=True, **settings)
        assert torch.equal(sharded, expected), settings
    sharded, expected = both(sim, model, input_ids=prompts(), max_new_tokens=NEW, do_sample=True, seed=4)
    assert torch.equal(sharded, expected)  # transformers' defaults: top_k=50


@pytest.mark.slow
def test_sampling_in_mode_1d():
    """Megatron-LM's layout (p=4): the same tokens; slow as the greedy 1-D case of test_generation."""
    model = gpt2()
    sim, captures = compiled(model, 2, 1, "1d")
    assert captures == 2
    for settings in SAMPLING:
        sharded, expected = both(sim, model, input_ids=prompts(), max_new_tokens=NEW, do_sample=True, **settings)
        assert torch.equal(sharded, expected), settings


def test_logits_processors_equal_the_unsharded_model(gpt2_sim):
    model, (sim, _) = gpt2_sim
    greedy = model.generate(prompts(), max_new_tokens=NEW, do_sample=False)
    eos = int(greedy[0, 6])  # a token greedy decoding gives early: min_new_tokens holds it back
    settings = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 3, "eos_token_id": eos,
                "suppress_tokens": [int(greedy[1, 5])], "bad_words_ids": [[int(greedy[2, 5])]]}
    for do_sample in (False, True):
        sharded, expected = both(sim, model, input_ids=prompts(), max_new_tokens=NEW, do_sample=do_sample,
                                 **settings)
        assert torch.equal(sharded, expected), do_sample


class _LengthAtLeast(StoppingCriteria):
    """Stops every sequence once it holds `length` tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_stopping_criteria_and_end_tokens_stop_as_the_unsharded_model(gpt2_sim):
    model, (sim, _) = gpt2_sim
    prompt = prompts()
    sharded, expected = both(sim, model, input_ids=prompt, max_new_tokens=NEW,
                             stopping_criteria=StoppingCriteriaList([_LengthAtLeast(8)]))
    assert torch.equal(sharded, expected) and sharded.shape[1] == 8
    greedy = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    eos = [int(greedy[0, 6]), int(greedy[1, 7])]  # two sequences end early, the others are padded after
    sharded, expected = both(sim, model, input_ids=prompt, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(sharded, expected)
    eos = [int(t) for t in greedy[:, 5]]  # every sequence ends at its first token: the loop stops there
    sharded, expected = both(sim, model, input_ids=prompt, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(sharded, expected) and sharded.shape[1] == 6


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_a_streamer_receives_the_tokens(gpt2_sim):
    model, (sim, _) = gpt2_sim
    sharded, expected = _Recorder(), _Recorder()
    for generator, streamer in ((sim, sharded), (model, expected)):
        torch.manual_seed(3)
        generator.generate(prompts(), max_new_tokens=3, do_sample=True, streamer=streamer)
    assert len(sharded.puts) == 1 + 3 and sharded.ended  # the prompt, then each step's tokens
    assert all(torch.equal(a, b) for a, b in zip(sharded.puts, expected.puts, strict=True))


def test_num_return_sequences_and_scores(gpt2_sim):
    """Two samples per prompt (the batch expanded as transformers does); the processed scores (float32) and
    the raw logits (in the model's dtype; transformers returns them in float32) of each step."""
    model, (sim, _) = gpt2_sim
    sharded, expected = both(sim, model, input_ids=prompts(2), max_new_tokens=4, do_sample=True, top_k=10,
                             num_return_sequences=2, return_dict_in_generate=True, output_scores=True,
                             output_logits=True)
    assert torch.equal(sharded.sequences, expected.sequences) and sharded.sequences.shape[0] == 4
    for ours, theirs in zip(sharded.scores, expected.scores, strict=True):
        assert ours.dtype == torch.float32 and torch.equal(torch.isinf(ours), torch.isinf(theirs))
        torch.testing.assert_close(ours.nan_to_num(neginf=0), theirs.nan_to_num(neginf=0), rtol=0, atol=1e-6)
    for ours, theirs in zip(sharded.logits, expected.logits, strict=True):
        assert ours.dtype == torch.float64
        torch.testing.assert_close(ours.float(), theirs, rtol=0, atol=1e-6)


def left_padded(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of 5, 3, 4 and 1 tokens, padded on the left with token 0 (the pad token)."""
    mask = torch.ones(batch, 5, dtype=torch.long)
    for row, pads in enumerate((0, 2, 1, 4)):
        mask[row, :pads] = 0
    return prompts(batch).masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.slow), "gpt2"])  # Llama's setup: 7 s
def test_left_padded_prompts_equal_the_unsharded_model(name, request):
    """Each prompt's position ids follow from its attention mask, as transformers derives them; the mask
    grows by one column a step. Greedy and sampled, the unsharded model's tokens: rotary positions (Llama)
    and a learned position table (GPT-2), which the step programs look up on the module's own shards."""
    model, (sim, _) = request.getfixturevalue(f"{name}_sim")
    prompt, mask = left_padded()
    for settings in ({"do_sample": False}, {"do_sample": True, "top_k": 10}):
        sharded, expected = both(sim, model, input_ids=prompt, attention_mask=mask, max_new_tokens=NEW, **settings)
        assert torch.equal(sharded, expected), settings


def test_beams_are_refused(gpt2_sim):
    _, (sim, _) = gpt2_sim
    with pytest.raises(ValueError, match=r"mesh \[q=2, q=2, d=2\]: num_beams=2 asks for beam search, .* generate "
                                         r"with the unsharded model \(model.generate\) for beams, or pass num_beams=1"):
        sim.generate(prompts(), num_beams=2, max_new_tokens=2)


def test_two_programs_serve_every_call(gpt2_sim):
    """Sampling, processors, streamers, padding and other batches run on the two programs the first call
    compiled: no capture after it."""
    sim, count = gpt2_sim[1]
    assert count == 3  # prefill and decode, and the decode of SUMMA's batch split, priced
    prompt, mask = left_padded(8)
    with counting_captures() as captures:
        sim.generate(prompts(8, 3), max_new_tokens=2, do_sample=True, repetition_penalty=1.2, streamer=_Recorder())
        sim.generate(prompt, attention_mask=mask, max_new_tokens=2, do_sample=True)
    assert captures == []


def _gloo_worker(rank, world_size):
    """Sampling over 8 gloo processes at [2, 2, 2]: the tokens of a first call (which compiles the programs)
    with every rank seeded alike, then of a call with each rank seeded otherwise (rank 0's tokens win)."""
    torch.set_num_threads(1)
    model = gpt2()
    sharded = tess_compile.shard(copy.deepcopy(model), 2, 2, example_inputs={"input_ids": prompts()}, dynamic=True,
                                 timeout=120)
    torch.manual_seed(3)
    alike = sharded.generate(prompts(), max_new_tokens=NEW, do_sample=True, top_p=0.9)
    torch.manual_seed(3 + rank)
    apart = sharded.generate(prompts(), max_new_tokens=NEW, do_sample=True, top_p=0.9)
    return alike, apart


@pytest.mark.slow
def test_sampling_over_gloo():
    results = run_local(_gloo_worker, 8, timeout_s=600)
    model = gpt2()
    torch.manual_seed(3)
    expected = model.generate(prompts(), max_new_tokens=NEW, do_sample=True, top_p=0.9)
    for alike, apart in results:
        assert torch.equal(alike, expected)
        assert torch.equal(apart, expected)  # rank 0 was seeded with 3 again: its tokens, broadcast
