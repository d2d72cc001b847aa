"""Models built on the meta device, end to end: build, compile, load a checkpoint shard by shard, run.

Their non-persistent buffers (rotary `inv_freq`, RoPE caches), which no
checkpoint holds, are recomputed by the code of the modules that own them
(`tess_compile.passes.meta_device`): equal to those of the model built on the CPU,
said once. A meta model with real (CPU) example inputs compiles, dumps and
simulates: it is captured on the meta device, and the device arguments of its
graph follow the run. Slow: `dump` of
transformers' GPT-2 and Llama built on the meta device, and a Llama built on the
meta device, sharded over 4 gloo processes (q=2, d=1), loaded from a
`save_pretrained` directory, whose logits and loss equal the unsharded model's
(float64; 1e-6, since Llama's own code computes its norms and RoPE in float32).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from hf_models import build
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM

import tess_compile
from tess_compile.passes.meta_device import recompute_meta_buffers
from tess_compile.runtime.launch import run_local
from tess_compile.training.shard_loading import load_shards_from

TOL = 1e-6  # float64, but Llama's RMSNorm and RoPE compute in float32 (measured: 3.5e-8)


class Config:
    """A config object, as transformers' modules take."""

    hidden, vocab, base = 8, 16, 100.0


class Rotary(nn.Module):
    """A transformers-style rotary table: a non-persistent buffer computed from the config at init."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        steps = torch.arange(0, config.hidden, 2, dtype=torch.float) / config.hidden
        self.register_buffer("inv_freq", 1.0 / config.base ** steps, persistent=False)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float)
        angles = positions[:, None] * self.inv_freq  # on the device of the weights
        return torch.cat((angles, angles), -1).cos().to(x.dtype)


class RotaryLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.rotary = Rotary(config)
        self.head = nn.Linear(config.hidden, config.vocab)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h * self.rotary(h))


def meta_model(cls, config):
    with torch.device("meta"):
        return cls(config)


def test_buffers_are_recomputed_by_their_modules_code(caplog):
    real = RotaryLM(Config())
    meta = meta_model(RotaryLM, Config())
    with caplog.at_level(logging.WARNING, logger="tess_compile"):
        assert recompute_meta_buffers(meta) == []
        assert recompute_meta_buffers(meta) == []  # nothing left to do: said once
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "rotary.inv_freq by Rotary rebuilt from its config" in said[0], said
    assert torch.equal(meta.rotary.inv_freq, real.rotary.inv_freq)
    assert meta.embed.weight.is_meta  # the weights wait for a checkpoint


def test_a_meta_model_with_real_inputs_dumps_and_simulates():
    ids = torch.randint(0, Config.vocab, (4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = tess_compile.dump(meta_model(RotaryLM, Config()), 2, 1, example_inputs=(ids,))
        sim = tess_compile.simulate(meta_model(RotaryLM, Config()), 2, 1, example_inputs=(ids,))
    assert "meta" not in text, text
    real = RotaryLM(Config())
    load_shards_from(sim, real.state_dict())
    torch.testing.assert_close(sim(ids), real(ids), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------
# slow: transformers' models
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name, cls", [("gpt2", GPT2LMHeadModel), ("llama", LlamaForCausalLM)])
def test_dump_takes_a_meta_transformers_model(name, cls):
    model, kwargs = build(name, 2, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = tess_compile.dump(meta_model(cls, model.config), 2, 1, example_inputs=kwargs)
    assert "# memory per rank" in text and "meta" not in text


def _llama_worker(rank, world_size, path):
    torch.set_num_threads(1)
    model, kwargs = build("llama", 2, 1, torch.float64)
    meta = meta_model(LlamaForCausalLM, model.config).to(torch.float64)
    sharded = tess_compile.shard(meta, 2, 1, example_inputs=kwargs, timeout=60)
    load_shards_from(sharded, path)
    out = sharded(**kwargs)
    logits = tess_compile.full_tensor(out.logits)
    return {"logits": logits if rank == 0 else None, "loss": tess_compile.full_tensor(out.loss)}


@pytest.mark.slow
def test_meta_llama_loads_save_pretrained_and_matches(tmp_path):
    model, kwargs = build("llama", 2, 1, torch.float64)
    model.save_pretrained(tmp_path)
    results = run_local(_llama_worker, 4, args=(str(tmp_path),), timeout_s=240, collective_timeout_s=120)
    with torch.no_grad():
        expected = model(**kwargs)
    assert (results[0]["logits"] - expected.logits).abs().max().item() <= TOL
    for rank, res in enumerate(results):
        assert abs(res["loss"].item() - expected.loss.item()) <= TOL, f"rank {rank}"
