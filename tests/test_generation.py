"""Sharded generation: `generate` on a transformers causal LM compiled with `dynamic=True`.

The oracle is the unsharded model in float64: the same greedy tokens, and each step's
logits equal to the unsharded model's logits at that position of the generated
sequence (1e-12). Two programs (prefill and decode) are compiled on the first
`generate` and none after: the tests count captures. The KV cache stays sharded (batch
over depth and row, heads over col) and only the logits are gathered. The gloo run
(8 processes) is in the slow tier.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from conftest import counting_captures
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import tess_compile
from tess_compile.generation import generate
from tess_compile.core.layout import Layout, Replicate, Shard, assemble
from tess_compile.runtime.launch import run_local

VOCAB, NEW = 64, 8


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
                        eos_token_id=None)
    return GPT2LMHeadModel(config).double().eval()


def prompts(batch: int = 4, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def compiled(model, q: int, d: int, mode: str = "2.5d"):
    """The model simulated with dynamic=True, its generation programs compiled by a first call; the
    number of captures that took."""
    sim = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs={"input_ids": prompts()}, dynamic=True,
                                mode=mode)
    with counting_captures() as captures:
        sim.generate(prompts(), max_new_tokens=1)
    return sim, len(captures)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=None)
    return LlamaForCausalLM(config).double().eval()


def worst_error(model, out, prompt_length: int) -> float:
    """The largest relative error of each step's logits against the unsharded model's at that
    position of the generated sequence; the tokens must be its greedy ones."""
    with torch.no_grad():
        full = model(out.sequences).logits
    worst = 0.0
    for step, logits in enumerate(out.logits):
        expected = full[:, prompt_length - 1 + step]
        assert torch.equal(out.sequences[:, prompt_length + step], expected.argmax(-1))
        worst = max(worst, ((logits - expected).abs().max() / expected.abs().max()).item())
    return worst


@pytest.mark.parametrize(("q", "d", "mode"), [(2, 2, "2.5d"), pytest.param(2, 1, "1d", marks=pytest.mark.slow)],
                         ids=["q2d2", "1d-p4"])
def test_greedy_generation_equals_the_unsharded_model(q, d, mode, request, monkeypatch):
    if mode == "2.5d":  # compiled for the generation tests once (conftest.py)
        model, sim, first = request.getfixturevalue("gpt2_generating")
    else:
        model = gpt2()
        sim, first = compiled(model, q, d, mode)
    own = sim.generation.model
    prompt = torch.randint(0, VOCAB, (4, 5))
    with counting_captures() as captures:
        out = sim.generate(prompt, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                           output_logits=True)
        assert worst_error(model, out, 5) < 1e-12
        assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=NEW, do_sample=False))
        for batch, length in ((8, 1), (4, 3)):  # a prompt of one token: decode from an empty cache
            prompt = torch.randint(0, VOCAB, (batch, length))
            out = sim.generate(input_ids=prompt, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
            assert worst_error(model, out, length) < 1e-12
    # prefill and decode, once, by the first call: no compile per token, length or batch; at [2,2,2] the decode
    # step of SUMMA's batch split is compiled too, to be priced against the weight-stationary one
    assert first == (2 if mode == "1d" else 3) and captures == []
    assert not own.training  # compiling the programs in eval mode left the model's mode as it was
    with pytest.raises(ValueError, match="max_new_tokens=63: the last step looks up position 64 in "
                                         "'transformer.wpe.weight', which has 64 rows"):
        sim.generate(prompt, max_new_tokens=63)  # refused before the first token
    if mode == "1d":  # transformers' GPT-2 differs at a batch of 1 where the batch is not split
        with pytest.raises(ValueError, match="outside the range at least 2"):
            sim(input_ids=torch.zeros(1, 3, dtype=torch.long))
    split = "none" if mode == "1d" else "depth"  # the first call's: decode priced faster weight-stationary
    assert list(sim.generation.programs)[0] == split
    for program in sim.generation.programs[split]:
        # the cache: batch over depth (2.5-D), heads over col, taken and given as each rank's block
        caches = [s for s in program.slots if s.role == "local input"]
        assert len(caches) == 4
        heads = Layout(Shard(0) if mode == "2.5d" else Replicate(), Replicate(), Shard(1))
        assert all(s.layout == heads for s in caches), [s.layout for s in caches]
        assert program.output_layouts[1:] == [s.layout for s in caches]
    # what generate refuses, with the fix (sampling, processors and streamers: tests/test_generation_sampling.py)
    with pytest.raises(ValueError, match=r"generation settings \{'guidance_scale': 1.5\} are not supported"):
        sim.generate(prompt, guidance_scale=1.5)
    with pytest.raises(ValueError, match=r"arguments \['token_type_ids'\] are not supported"):
        sim.generate(prompt, token_type_ids=torch.zeros_like(prompt))
    monkeypatch.setattr(sim, "generation", None)  # as a module compiled without dynamic=True has it
    with pytest.raises(ValueError, match="compiled with dynamic=True"):
        sim.generate(prompt)


@pytest.mark.parametrize(("q", "d", "mode"), [(2, 2, "2.5d"), pytest.param(2, 1, "1d", marks=pytest.mark.slow)],
                         ids=["q2d2", "1d-p4"])
def test_a_long_prompt_prefills_with_its_tokens_split(q, d, mode, request, monkeypatch):
    """A single prompt of LONG_PROMPT tokens or more is prefilled by a static program whose tokens split
    over the mesh (no rank repeats another's work, where the dynamic prefill of one prompt runs whole over
    depth and row); its cache is laid out once for the decode program: the unsharded model's tokens."""
    if mode == "2.5d":  # the shared module, with a generation of its own (the fixture's programs left as they are)
        model, sim, _ = request.getfixturevalue("gpt2_generating")
        own = sim.generation
        monkeypatch.setattr(sim, "generation", generate.Generation(own.model, own.mesh, own.options, own.cluster))
    else:
        model = gpt2()
        sim, _ = compiled(model, q, d, mode)
    monkeypatch.setattr(generate, "LONG_PROMPT", 8)
    prompt = prompts(batch=1, length=16, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = sim.generation._long_prefill(sim, prompt)
    assert program.rows.tokens == ("col" if mode == "1d" else "depth_row")
    assert not [str(w.message) for w in caught if "repeat" in str(w.message)]  # under 5% repeated in all
    out = sim.generate(prompt, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
    assert worst_error(model, out, 16) < 1e-12


@pytest.mark.slow
def test_generation_through_inductor():
    """compile=True: the prefill and decode programs through inductor, symbolic in batch and cached
    length: the same tokens and logits, and no compile per token or per call."""
    model = gpt2()
    prompt = torch.randint(0, VOCAB, (8, 5))  # two blocks of batch per rank: a batch of one block is its own code
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs={"input_ids": prompt}, dynamic=True,
                                compile=True)
    out = sim.generate(prompt, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True)
    assert worst_error(model, out, 5) < 1e-12
    compiles = []
    for length in (3, 6):  # another batch, then another prompt length
        prompt = torch.randint(0, VOCAB, (16, length))
        expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(sim.generate(prompt, max_new_tokens=NEW), expected)
        compiles.append(sum(c.compiles() for c in sim._compiled.values()))
    # code for sizes of 2 or more and for the 0/1 sizes met (a batch of one block, an empty cache): none per token
    assert compiles[0] == compiles[1] <= 4, compiles


@pytest.mark.slow
def test_llama_with_grouped_query_attention():
    """Tokens exact; logits to 1e-7: transformers' Llama computes its rotary tables in float32, and the
    static program differs from the unsharded model by as much (5.9e-8 here)."""
    model = llama()
    prompt = torch.randint(0, VOCAB, (4, 4))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs={"input_ids": prompt}, dynamic=True)
    out = sim.generate(prompt, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
    assert worst_error(model, out, 4) < 1e-7


def _gloo_worker(rank, world_size):
    """Greedy generation over 8 gloo processes at [2, 2, 2]: the worst logit error, the tokens, the compiles."""
    torch.set_num_threads(1)
    model = gpt2()
    prompt = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))
    sharded = tess_compile.shard(copy.deepcopy(model), 2, 2, example_inputs={"input_ids": prompt}, dynamic=True,
                                 timeout=120)
    with counting_captures() as captures:
        out = sharded.generate(prompt, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True)
        out = sharded.generate(prompt[:, :3], max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True)
    generate.LONG_PROMPT = 8  # a process of its own: a prompt of 16 tokens is long here
    long = sharded.generate(prompt[:1].repeat(1, 4)[:, :16], max_new_tokens=4, return_dict_in_generate=True,
                            output_logits=True)
    worst = max(worst_error(model, out, 3), worst_error(model, long, 16))
    return (worst, out.sequences, len(captures), sharded.generation._long_prefills[16].rows.tokens,
            list(sharded.generation.programs))


@pytest.mark.slow
def test_generation_over_gloo():
    results = run_local(_gloo_worker, 8, timeout_s=600)
    for worst, sequences, compiles, tokens, splits in results:
        assert worst < 1e-12
        assert torch.equal(sequences, results[0][1])
        assert compiles == 3  # prefill and decode, and the decode of the other split, timed
        assert tokens == "depth_row"  # the long prompt's prefill split its tokens
        assert splits == results[0][4] and splits[0] in ("depth_row", "depth")  # measured, agreed by every rank


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0), persistent=False)  # a constant of the program

    def forward(self, x):
        return self.proj(x) * self.scale


def test_an_adopted_program_brings_its_own_constants():
    """Another program of the model (a generation step's) runs on the same shards; a constant whose name
    the first program holds with another value is renamed, never read from the first program's."""
    sim = tess_compile.simulate(_Scaled(), 2, 1, example_inputs=(torch.ones(4, 4),))
    same = sim.adopt(sim.program)
    assert [s.name for s in same.slots] == [s.name for s in sim.program.slots]
    other = dataclasses.replace(sim.program, tensors={**sim.program.tensors, "scale": torch.ones(4)})
    adopted = sim.adopt(other)
    renamed = next(s for s in adopted.slots if s.role == "constant")
    assert renamed.name == "scale_0" and torch.equal(adopted.tensors["scale_0"], torch.ones(4))
    assert torch.equal(sim.program.tensors["scale"], torch.arange(4.0))
    blocks = [sim.ranks[r].get_buffer("scale_0") for r in range(4)]
    assert torch.equal(assemble(blocks, renamed.layout, sim.mesh), torch.ones(4))


@pytest.mark.slow
def test_generation_takes_keep_blocks_auto():
    """keep_blocks="auto" is resolved for the prefill and decode programs too (it raised before)."""
    model = gpt2()
    prompt = torch.randint(0, VOCAB, (4, 5))
    sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs={"input_ids": prompt}, dynamic=True,
                                keep_blocks="auto")
    out = sim.generate(prompt, max_new_tokens=3, return_dict_in_generate=True, output_logits=True)
    assert worst_error(model, out, 5) < 1e-12
