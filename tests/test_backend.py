"""The torch.compile backend: parity with the unsharded model through Dynamo, with
graph breaks, simulated and over real gloo processes, by object and by name; Dynamo's
symbolic graphs compiled once for every shape, and the ValueErrors of what they cannot take."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel, counting_captures
from models import GPTBlock, LlamaBlock, TinyGPT, mesh_id

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


def _check(compiled_model, model, oracle, x, name, rtol=1e-5):
    out, expected = compiled_model(x), oracle(x)
    target = torch.randn_like(expected)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    assert_close_rel(out, expected, rtol, name=f"{name} output")
    for (pname, param), ref in zip(model.named_parameters(), oracle.parameters()):
        assert param.grad is not None, pname
        assert_close_rel(param.grad, ref.grad, rtol, name=f"{name} grad {pname}")


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


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(32, 16, 4, 1, 24).double()


# (batch, sequence): lengths 2 to the position table's end, and other batches (2: one block per rank)
SHAPES = [(8, 12), (8, 3), (12, 24), (4, 5)]  # multiples of d*q = 4, one block per rank among them


def test_dynamic_graphs_compile_once():
    """torch.compile(..., dynamic=True): Dynamo's symbolic graph is one dynamic program (the embedding
    tables, graph inputs here, stay fixed); every shape gives the unsharded model's outputs and
    gradients in float64."""
    torch._dynamo.reset()
    model = tiny_gpt()
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend=tess_compile.backend(2, 2, simulate=True), dynamic=True)
    with counting_captures() as compiles:
        for batch, length in SHAPES:
            _check(compiled, model, oracle, torch.randint(0, 32, (batch, length)), f"shape [{batch}, {length}]", 1e-12)
    assert len(compiles) == 1, f"{len(compiles)} compiles for {len(SHAPES)} shapes"


@pytest.mark.slow
@pytest.mark.parametrize("how, num_compiles", [("mark_dynamic", 1), ("automatic", 2)])
def test_marked_and_automatic_dynamic(how, num_compiles):
    """mark_dynamic on the sequence: one program, symbolic in it, the batch fixed as Dynamo holds it.
    Dynamo's default: a static program for the first shape, then one symbolic where the shapes changed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPTBlock(8, 2).double()
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend=tess_compile.backend(2, 1, simulate=True))
    with counting_captures() as compiles:
        for length in (5, 3, 8, 11):
            x = torch.randn(4, length, 8, dtype=torch.float64)
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 1)
            _check(compiled, model, oracle, x, f"{how}, sequence {length}", 1e-12)
    assert len(compiles) == num_compiles


class SizesAcrossABreak(torch.nn.Module):
    """Sizes read before a graph break and used after it: Dynamo returns them from the first graph."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        b, s, h = x.shape
        y = self.lin(x)
        torch._dynamo.graph_break()
        return self.lin(y).reshape(b, s * h)


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        return self.lin(x) * scale


def test_what_a_dynamic_graph_cannot_take():
    """Sizes returned from a graph, int arguments, a float that changes, a batch that does not split:
    ValueErrors that name the graph's input or output, the shapes, the mesh and the fix."""
    backend = tess_compile.backend(2, 1, simulate=True)
    x = torch.randn(4, 6, 8)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"graph output 0 \(s\d+\) is s\d+, a torch.SymInt .*inputs L_x_ "
                                        r"\[s\d+, s\d+, 8\].*mesh \[q=2, q=2, d=1\].*after the break \(x.shape\)"):
        torch.compile(SizesAcrossABreak(), backend=backend, dynamic=True)(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"graph input 'L_scale_' is the symbolic int s\d+, which is no dim of the "
                                        r"graph's tensor inputs .*specialize_int = True"):
        torch.compile(Scaled(), backend=backend, dynamic=True)(x, 3)
    torch._dynamo.reset()
    compiled = torch.compile(Scaled(), backend=backend, dynamic=True)
    compiled(x, 0.5)
    with pytest.raises(ValueError, match=r"graph input 'L_scale_' is the Python number 0.7, but the program on mesh "
                                         r"\[q=2, q=2, d=1\] was compiled for 0.5 .*specialize_float = True"):
        compiled(x, 0.7)
    with pytest.raises(ValueError, match=r"\(shape \[3, 6, 8\]\): 3 is not divisible by 2 .*a multiple of 2"):
        compiled(torch.randn(3, 6, 8), 0.5)


def test_the_dynamic_option_on_a_static_graph(caplog):
    """The backend's dynamic=True cannot make Dynamo's static graph symbolic (its code holds the sizes):
    it is compiled for its shapes, with a warning that gives the fix."""
    torch._dynamo.reset()
    model = torch.nn.Linear(8, 8).double()
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend=tess_compile.backend(2, 1, simulate=True, dynamic=True), dynamic=False)
    _check(compiled, model, oracle, torch.randn(4, 3, 8, dtype=torch.float64), "static graph", 1e-12)
    assert "graph of static shapes (inputs L_args_0_ [4, 3, 8])" in caplog.text
    assert "pass dynamic=True to torch.compile as well" in caplog.text


def _gloo_dynamic_worker(rank, world_size):
    """TinyGPT through Dynamo with dynamic=True over gloo: one compile, every shape exact in float64."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    model = tiny_gpt()
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend=tess_compile.backend(2, 1, timeout=60), dynamic=True)
    with counting_captures() as compiles:
        for batch, length in SHAPES:
            torch.manual_seed(batch * 100 + length)
            try:
                _check(compiled, model, oracle, torch.randint(0, 32, (batch, length)), f"[{batch}, {length}]", 1e-12)
            except AssertionError as err:
                return str(err)
    return len(compiles)


@pytest.mark.slow
def test_gloo_dynamic_backend():
    for rank, result in enumerate(run_local(_gloo_dynamic_worker, 4, timeout_s=240)):
        assert result == 1, f"rank {rank}: {result}"
