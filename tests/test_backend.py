"""The torch.compile backend: parity with the unsharded model through Dynamo, with
graph breaks, simulated and over real gloo processes, by object and by name."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel
from models import GPTBlock, LlamaBlock, mesh_id

import tess_compile
from tess_compile.runtime.launch import run_local

MESHES = [(2, 1), (2, 2)]


class TwoBlocks(torch.nn.Module):
    """Two GPT blocks with a deliberate graph break between them."""

    def __init__(self):
        super().__init__()
        self.first, self.second = GPTBlock(8, 2), GPTBlock(8, 2)

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def _check(compiled_model, model, oracle, x, name):
    out, expected = compiled_model(x), oracle(x)
    target = torch.randn_like(expected)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    assert_close_rel(out, expected, name=f"{name} output")
    for (pname, param), ref in zip(model.named_parameters(), oracle.parameters()):
        assert param.grad is not None, pname
        assert_close_rel(param.grad, ref.grad, name=f"{name} grad {pname}")


@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
@pytest.mark.parametrize("kind", ["gpt", "llama", "graph-break"])
def test_simulated_backend_parity(kind, q, d):
    torch._dynamo.reset()
    model = {"gpt": lambda: GPTBlock(8, 2), "llama": lambda: LlamaBlock(8, 2), "graph-break": TwoBlocks}[kind]()
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend=tess_compile.backend(q, d, simulate=True))
    _check(compiled, model, oracle, torch.randn(2 * q * d, 3, 8), kind)


def test_backend_by_name_and_bad_options():
    torch._dynamo.reset()
    model = GPTBlock(8, 2)
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tesseract", options={"q": 2, "d": 2, "simulate": True})
    _check(compiled, model, oracle, torch.randn(4, 3, 8), "by name")
    torch._dynamo.reset()
    bad = torch.compile(GPTBlock(8, 2), backend="tesseract", options={"q": 2})
    with pytest.raises(Exception, match="needs q and d"):
        bad(torch.randn(4, 3, 8))


def _gloo_worker(rank, world_size, q, d):
    torch.manual_seed(0)
    results = {}
    for kind, make in (("gpt", lambda: GPTBlock(8, 2)), ("graph-break", TwoBlocks)):
        torch._dynamo.reset()
        model = make()
        oracle = copy.deepcopy(model)
        compiled = torch.compile(model, backend=tess_compile.backend(q, d, timeout=60))
        try:
            _check(compiled, model, oracle, torch.randn(2 * q * d, 3, 8), kind)
            results[kind] = "ok"
        except AssertionError as err:
            results[kind] = str(err)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("q, d", MESHES, ids=[mesh_id(q, d) for q, d in MESHES])
def test_gloo_backend_parity(q, d):
    results = run_local(_gloo_worker, q * q * d, args=(q, d), timeout_s=240)
    for rank, result in enumerate(results):
        assert result == {"gpt": "ok", "graph-break": "ok"}, f"rank {rank}: {result}"


@pytest.mark.parametrize("options", [{"recompute": "blocks"}, {"keep_blocks": True}], ids=["blocks", "keep"])
def test_backend_memory_options(options):
    """A stack of blocks through Dynamo, recomputed per block or keeping fetched blocks."""
    from models import GPTStack

    torch._dynamo.reset()
    model = GPTStack(8, 2, 2)
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tesseract", options={"q": 2, "d": 2, "simulate": True, **options})
    _check(compiled, model, oracle, torch.randn(4, 3, 8), str(options))


def test_backend_with_the_model_s_own_checkpoint():
    """Dynamo traces torch.utils.checkpoint into its own operator; the graph still runs exactly."""
    from models import GPTStack

    torch._dynamo.reset()
    model = GPTStack(8, 2, 2, checkpoint="non-reentrant")
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend=tess_compile.backend(2, 2, simulate=True))
    _check(compiled, model, oracle, torch.randn(4, 3, 8), "checkpointed model")
