"""Models that branch on data: a mixture of experts that loops over the experts a batch hits, attention
that branches on `mask.any()`, a vision-language model that picks its images by a boolean index.
`shard`, `simulate` and `dump` refuse them with a ValueError naming the model's line and the fixes
(passes/data_dependent.py); the torch.compile backend breaks the graph there and shards each piece,
exactly in float64, or names the graph break whose rows it cannot split (docs/data_dependent.md)."""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_close_rel, counting_captures
from torch import nn

import tess_compile

Q, D = 2, 2  # rows of a batch split over d*q = 4 ranks


class LoopedExperts(nn.Module):
    """Top-1 routing over 3 experts; only the experts that some token hit run."""

    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(8, 3), nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        routing, out = weights.argmax(-1), torch.zeros_like(x)
        for e in torch.unique(routing).tolist():
            out = out + torch.where((routing == e)[..., None], self.experts[e](x) * weights[..., e:e + 1], 0.0)
        return out


class HitExperts(LoopedExperts):
    """The loop of transformers' eager experts: over `nonzero()` of the experts hit."""

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        routing, out = weights.argmax(-1), torch.zeros_like(x)
        hit = torch.greater(nn.functional.one_hot(routing, 3).sum((0, 1)), 0).nonzero()
        for e in hit:
            e = int(e[0])
            out = out + torch.where((routing == e)[..., None], self.experts[e](x) * weights[..., e:e + 1], 0.0)
        return out


class MaskedAttention(nn.Module):
    """Attention that masks its scores only when the mask holds a True."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2)
        if mask.any().item():
            scores = scores.masked_fill(mask, -1e9)
        return self.out(scores.softmax(-1) @ v)


class PickedImages(nn.Module):
    """A vision-language model that encodes only the real images, picked by a boolean index."""

    def __init__(self):
        super().__init__()
        self.vision, self.text = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, pixel_values, image_mask, x):
        images = self.vision(pixel_values[image_mask])
        return self.text(x) + images.mean(0)


def _inputs(name: str, num_images: int = 3) -> tuple:
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8, dtype=torch.float64)
    if name == "masked attention":
        return x, torch.rand(4, 6, 6) > 0.7
    if name == "picked images":
        return torch.randn(8, 8, dtype=torch.float64), torch.arange(8) < num_images, x
    return (x,)


# (model, the code of the line the error names)
PATTERNS = {
    "looped experts": (LoopedExperts, "for e in torch.unique(routing).tolist():"),
    "hit experts": (HitExperts, "for e in hit:"),
    "masked attention": (MaskedAttention, "if mask.any().item():"),
    "picked images": (PickedImages, "images = self.vision(pixel_values[image_mask])"),
}


def _line_of(cls: type, code: str) -> str:
    """`test_data_dependent.py:N` of the line of `cls`'s source that holds `code`."""
    lines, first = inspect.getsourcelines(cls)
    return f"{Path(__file__).name}:{first + next(i for i, line in enumerate(lines) if code in line)}"


def _model(cls: type) -> nn.Module:
    torch.manual_seed(1)
    return cls().double()


@pytest.mark.parametrize("name", list(PATTERNS))
def test_simulate_names_the_line_and_the_fix(name):
    cls, code = PATTERNS[name]
    with pytest.raises(ValueError) as info:
        tess_compile.simulate(_model(cls), Q, D, example_inputs=_inputs(name))
    msg = str(info.value)
    assert re.search(re.escape(_line_of(cls, code)) + r" \(`" + re.escape(code) + "`\\)", msg), msg
    assert f"{cls.__name__}'s forward" in msg, msg
    assert "torch.where" in msg and "torch.compile(model, backend=tess_compile.backend(q=..., d=...))" in msg, msg
    if name == "picked images":
        assert "aten.index.Tensor" in msg and "gives shape [u0, 8]" in msg and "pad the picked rows" in msg, msg
    else:
        assert "cannot decide `Eq(u0, " in msg and "experts_implementation=\"batched_mm\"" in msg, msg
    if name == "hit experts":
        assert "(u0 = hit.shape[0])" in msg, msg  # torch's own name of the symbol


@pytest.mark.parametrize("entry", ["shard", "dump"])
def test_shard_and_dump_raise_it_too(entry):
    """All entry points capture through passes/capture.py (shard fails before it needs a process group)."""
    with pytest.raises(ValueError, match=re.escape(_line_of(MaskedAttention, "if mask.any().item():"))):
        getattr(tess_compile, entry)(_model(MaskedAttention), Q, D, example_inputs=_inputs("masked attention"))


def test_dynamic_capture_raises_it_too():
    with pytest.raises(ValueError, match=re.escape(_line_of(LoopedExperts, "tolist()"))):
        tess_compile.simulate(_model(LoopedExperts), Q, D, example_inputs=_inputs("looped experts"), dynamic=True)


class EveryExpert(LoopedExperts):
    """Way out 1: every expert on every token, weighted zero where the token is not routed to it."""

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        routing, out = weights.argmax(-1), torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + torch.where((routing == e)[..., None], expert(x) * weights[..., e:e + 1], 0.0)
        return out


class AlwaysMasked(MaskedAttention):
    """Way out 1: masking with a mask that holds no True changes nothing, so no branch."""

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out((q @ k.transpose(-1, -2)).masked_fill(mask, -1e9).softmax(-1) @ v)


class EveryImage(PickedImages):
    """Way out 1: every image slot encoded, the others masked out of the mean."""

    def forward(self, pixel_values, image_mask, x):
        images = torch.where(image_mask[:, None], self.vision(pixel_values), 0.0)
        return self.text(x) + images.sum(0) / image_mask.sum()


@pytest.mark.parametrize("cls, name", [(EveryExpert, "looped experts"), (AlwaysMasked, "masked attention"),
                                       (EveryImage, "picked images")], ids=["experts", "attention", "images"])
def test_written_without_reading_values(cls, name):
    """The rewrites that docs/data_dependent.md gives shard as one graph, exactly, and equal the branching model."""
    inputs = _inputs(name, num_images=3)
    model = _model(cls)
    sharded = tess_compile.simulate(model, Q, D, example_inputs=inputs)
    assert_close_rel(tess_compile.full_tensor(sharded(*inputs)), model(*inputs), 1e-12, name=cls.__name__)
    branching = PATTERNS[name][0]()
    branching.load_state_dict(model.state_dict())
    assert_close_rel(model(*inputs), branching.double()(*inputs), 1e-12, name=f"{cls.__name__} vs the branch")


def _check_backend(cls: type, *inputs, oracle=None, model=None, pieces: int | None = None):
    """The model through the simulated torch.compile backend: output and every gradient equal the
    unsharded model's to 1e-12 (float64); `pieces`: the number of graph pieces compiled (not run as eager code)."""
    model = model if model is not None else _model(cls)
    oracle = oracle if oracle is not None else copy.deepcopy(model)
    compiled = torch.compile(model, backend=tess_compile.backend(q=Q, d=D, simulate=True))
    with counting_captures() as captures:
        out, expected = compiled(*inputs), oracle(*inputs)
    assert pieces is None or len(captures) == pieces, f"{len(captures)} pieces compiled, not {pieces}"
    target = torch.randn_like(expected)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    assert_close_rel(out, expected, 1e-12, name=f"{cls.__name__} output")
    for (name, param), reference in zip(model.named_parameters(), oracle.parameters()):
        assert (param.grad is None) == (reference.grad is None), name
        if reference.grad is not None:
            assert_close_rel(param.grad, reference.grad, 1e-12, name=f"{cls.__name__} grad {name}")
    model.zero_grad()
    oracle.zero_grad()
    return model, oracle


@pytest.mark.parametrize("name", ["looped experts", "masked attention"])
def test_backend_shards_each_piece_exactly(name):
    """Both pieces, before the value is read and after it, are sharded."""
    torch._dynamo.reset()
    _check_backend(PATTERNS[name][0], *_inputs(name), pieces=2)


def _routed_to(experts: list[int]) -> torch.Tensor:
    """Tokens [4, 1, 8] that a LoopedExperts whose router reads x[..., :3] sends to `experts`, in turn."""
    torch.manual_seed(len(experts))
    x = torch.randn(4, 1, 8, dtype=torch.float64)
    x[..., :3] = -5.0
    for token in range(4):
        x[token, 0, experts[token % len(experts)]] = 5.0
    return x


def test_backend_specializes_on_the_experts_hit():
    """After `.tolist()` Dynamo compiles the loop for the experts hit; on another set it passes them as symbolic
    ints, which the backend refuses with the fix; with specialize_int=True each set is one more exact compile."""
    torch._dynamo.reset()
    model = _model(LoopedExperts)
    with torch.no_grad():
        model.router.weight.zero_()
        model.router.weight[:, :3] = torch.eye(3, dtype=torch.float64)
    model, oracle = _check_backend(LoopedExperts, _routed_to([0, 1]), model=model)
    refused = (r"graph input 'L_stack0_1_' is the symbolic int 2, .*read with \.tolist\(\) carried across a graph "
               r"break\): set torch._dynamo.config.specialize_int = True")
    with pytest.raises(Exception, match=refused):
        _check_backend(LoopedExperts, _routed_to([0, 2]), model=model, oracle=oracle)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_int=True):
        for experts in ([0, 1], [0, 2], [2]):
            _check_backend(LoopedExperts, _routed_to(experts), model=model, oracle=oracle)


def test_backend_picked_rows_must_split():
    """The picked images are the batch of the piece after the graph break: exact while their number is a
    multiple of d*q, a ValueError naming the break's line otherwise."""
    torch._dynamo.reset()
    model, oracle = _check_backend(PickedImages, *_inputs("picked images", num_images=4), pieces=1)
    code = "images = self.vision(pixel_values[image_mask])"
    expected = (rf"graph input 'L_stack1_' of shape \[3, 8\], carried across the graph break at .*"
                rf"{re.escape(_line_of(PickedImages, code))} \(`{re.escape(code)}`\), has dim 0 of size 3, .* splits "
                r"over d\*q = 4 ranks: .*keep their number a fixed multiple of 4")
    with pytest.raises(Exception, match=expected):
        _check_backend(PickedImages, *_inputs("picked images", num_images=3), model=model, oracle=oracle)


@pytest.mark.parametrize("flag, name, node, what", [
    ("capture_scalar_outputs", "masked attention", "item", r"Eq\(u0, 1\), returned by the graph, a value read"),
    ("capture_dynamic_output_shape_ops", "picked images", "getitem", r"a tensor of shape \[u0, 8\], a size read"),
])
def test_backend_with_values_in_dynamo_s_graph(flag, name, node, what):
    """With Dynamo's flags that keep values read from tensors in its graph, the backend names the op and the flag."""
    torch._dynamo.reset()
    cls, code = PATTERNS[name]
    expected = rf"{node} at .*{re.escape(_line_of(cls, code))} .* is {what} from the data, .*{flag}.* is on; "
    with torch._dynamo.config.patch(**{flag: True}), pytest.raises(Exception, match=expected):
        _check_backend(cls, *_inputs(name, num_images=4))


class TableAcrossABreak(nn.Module):
    """A table of batch 1 (as rotary angles) made before a branch on data and used after it."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask):
        angles = torch.arange(x.shape[1], dtype=x.dtype)[None, :, None] * torch.linspace(0.1, 1, 8, dtype=x.dtype)
        y = self.lin(x)
        if mask.any():
            y = y.masked_fill(mask[..., None], 0.0)
        torch._dynamo.graph_break()
        causal = torch.ones(1, x.shape[1], x.shape[1], dtype=x.dtype).tril()  # a piece of constants only
        torch._dynamo.graph_break()
        return self.out(causal @ (y * angles.cos() + y.flip(-1) * angles.sin()))


def test_backend_takes_tables_and_constant_pieces():
    """A batch-1 table crossing the break arrives whole (its consumers lay it out); a piece that takes no
    tensor runs as it is."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    _check_backend(TableAcrossABreak, torch.randn(4, 6, 8, dtype=torch.float64), torch.rand(4, 6) > 0.5, pieces=3)


@pytest.mark.slow
@pytest.mark.parametrize("config, model_name", [("MixtralConfig", "MixtralForCausalLM"),
                                                ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")], ids=["mixtral", "qwen2-moe"])
def test_transformers_eager_experts(config, model_name):
    """transformers' eager experts loop over `expert_hit`: the ValueError names that line of the model's
    file; experts_implementation="batched_mm", the fix it gives, shards exactly."""
    import transformers

    def make(experts):
        torch.manual_seed(0)
        cfg = getattr(transformers, config)(
            vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=32, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
            experts_implementation=experts, tie_word_embeddings=False)
        return getattr(transformers, model_name)(cfg).double()

    ids = torch.randint(0, 64, (4, 8))
    with pytest.raises(ValueError, match=r"/models/\w+/modeling_\w+\.py:\d+ \(`for expert_idx in expert_hit:`\)"
                                         r".*\(u0 = expert_hit.shape\[0\]\).*experts_implementation=\"batched_mm\""):
        tess_compile.simulate(make("eager"), Q, D, example_inputs=(ids,))
    model = make("batched_mm")
    sharded = tess_compile.simulate(model, Q, D, example_inputs=(ids,))
    assert_close_rel(tess_compile.full_tensor(sharded(ids).logits), model(ids).logits, 1e-6, name="logits")
