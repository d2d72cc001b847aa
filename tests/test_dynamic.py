"""Dynamic shapes: `dynamic=True` compiles once for every batch and sequence length.

The batch is captured as a symbolic multiple of the ranks that split it, the sequence
as a symbol; the per-rank program computes its local sizes from the inputs' at run
time. Every length gives the unsharded model's outputs and gradients in float64; a
shape the program cannot take is a ValueError that names the input, its dims, the
mesh and the fix. The gloo run is in the slow tier.
"""

from __future__ import annotations

import copy
import re

import pytest
import sympy
import torch
from conftest import assert_close_rel, counting_captures
from models import GPTStack, TinyGPT
from transformers import GPT2Config, GPT2LMHeadModel

import tess_compile
from tess_compile.passes.driver import compile_model
from tess_compile.core.dynamic import DynamicShapes
from tess_compile.core.mesh import Mesh
from tess_compile.runtime.launch import run_local

MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
IDS = ["q2d2", "1d-p4"]
VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS = 32, 16, 4, 2, 24
LENGTHS = [12, 1, 2, 3, 5, 8, 13, 17, 23, 24]  # ten sequence lengths, one and the table's end among them


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS).double()


def check_call(model, sharded, ids, what: str) -> None:
    """Outputs and every gradient of a call equal the unsharded model's (float64)."""
    expected, actual = model(ids), sharded(ids)
    assert_close_rel(actual, expected, 1e-12, f"{what} output")
    weights = torch.linspace(-1, 1, expected.numel(), dtype=torch.float64).view_as(expected)
    (expected * weights).sum().backward()
    (actual * weights).sum().backward()
    grads = sharded.full_grads()
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"{what} grad {name}")
    model.zero_grad()
    sharded.zero_grad()


@pytest.mark.parametrize("q,d,mode", MESHES, ids=IDS)
def test_one_compile_for_every_length(q, d, mode):
    model = tiny_gpt()
    batch = 2 * Mesh(q, d, mode).size("depth") * Mesh(q, d, mode).size("row")
    with counting_captures() as captures:
        sharded = tess_compile.simulate(copy.deepcopy(model), q, d, example_inputs=(torch.randint(0, VOCAB, (batch, 12)),),
                                        mode=mode, dynamic=True)
        for length in LENGTHS:
            check_call(model, sharded, torch.randint(0, VOCAB, (batch, length)), f"sequence {length}")
        for batches in (1, 3):  # other batches, one block per rank among them
            ids = torch.randint(0, VOCAB, (batches * batch // 2, 7))
            check_call(model, sharded, ids, f"batch {ids.shape[0]}")
    assert len(captures) == 1, f"{len(captures)} compiles for {len(LENGTHS) + 2} shapes"
    assert sharded.program.dynamic is not None


def test_shapes_it_cannot_take_are_value_errors():
    sharded = tess_compile.simulate(tiny_gpt(), 2, 2, example_inputs=(torch.randint(0, VOCAB, (8, 12)),), dynamic=True)
    with pytest.raises(ValueError, match=r"dim 0 of positional input 0 \(shape \[6, 12\]\): 6 is not divisible by 4 "
                                         r".*mesh \[q=2, q=2, d=2\]\): use a batch that is a multiple of 4"):
        sharded(torch.randint(0, VOCAB, (6, 12)))
    with pytest.raises(ValueError, match=r"positional input 0 .* has 3 dims, but the module was compiled for 2"):
        sharded(torch.randint(0, VOCAB, (8, 12, 1)))
    with pytest.raises(ValueError, match=rf"dim 1 of positional input 0 = {POSITIONS + 1}: the model looks up position "
                                         rf"{POSITIONS} .* in 'positions.weight', which has {POSITIONS} rows, on mesh"):
        sharded(torch.randint(0, VOCAB, (8, POSITIONS + 1)))  # a sequence past the position table
    with pytest.raises(ValueError, match=r"batch_split='depth_row': the inputs' batch 6 is not divisible by the 4 "
                                         r"ranks that split it .* or batch_split='auto'"):
        tess_compile.simulate(tiny_gpt(), 2, 2, example_inputs=(torch.randint(0, VOCAB, (6, 12)),), dynamic=True,
                              batch_split="depth_row")


def test_a_batch_that_does_not_split_over_row_is_taken():
    """batch_split="auto": an example batch of 6 at [2,2,2] splits over depth alone (a symbolic multiple
    of 2), and a batch of one stays whole: both programs run every batch they take exactly, their
    products weight-stationary."""
    model = tiny_gpt()
    for example, calls in ((6, (2, 10)), (1, (1,))):
        sharded = tess_compile.simulate(copy.deepcopy(model), 2, 2,
                                        example_inputs=(torch.randint(0, VOCAB, (example, 12)),), dynamic=True)
        for batch in calls:
            check_call(model, sharded, torch.randint(0, VOCAB, (batch, 9)), f"batch {batch}")
    with pytest.raises(ValueError, match="an example batch of 1 fixes the batch, as torch.compile specialises it"):
        sharded(torch.randint(0, VOCAB, (2, 9)))


def test_dims_the_weights_fix_stay_fixed():
    """Hidden states [b, s, h]: the hidden size meets the weights and stays a constant; batch and
    sequence are symbols, and a call with another hidden size is refused."""
    torch.manual_seed(0)
    model = GPTStack(HIDDEN, HEADS, 1).double()
    sharded = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(torch.randn(4, 6, HIDDEN).double(),),
                                    dynamic=True)
    (batch, sequence, hidden), = sharded.program.dynamic.inputs.values()
    assert batch.free_symbols and sequence.free_symbols and hidden == HIDDEN
    x = torch.randn(8, 11, HIDDEN, dtype=torch.float64)
    assert_close_rel(sharded(x), model(x), 1e-12, "hidden states")
    with pytest.raises(ValueError, match=r"dim 2 of positional input 0 \(shape \[4, 6, 8\]\): dim is 8, but the module "
                                         r"was compiled for 16 there .* pass 16"):
        sharded(torch.randn(4, 6, HIDDEN // 2, dtype=torch.float64))


def test_hugging_face_gpt2_with_labels():
    """GPT-2 as transformers builds it (dropout 0.1, train mode), ids and labels as keywords: one compile,
    every length exact, the same dropout masks as the unsharded model's under the same seed."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB * 2, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=1, n_head=HEADS)
    model = GPT2LMHeadModel(config).double()

    def inputs(length):
        ids = torch.randint(0, VOCAB * 2, (4, length))
        return {"input_ids": ids, "labels": ids}

    with counting_captures() as captures:
        sharded = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=inputs(10), dynamic=True)
        for length in (10, 3, 17):
            given = inputs(length)
            torch.manual_seed(length)
            expected = model(**given)
            torch.manual_seed(length)
            actual = sharded(**given)
            assert_close_rel(actual.logits, expected.logits, 1e-12, f"logits at {length}")
            # transformers takes the loss in float32 (its logits upcast): float32's rounding
            assert_close_rel(actual.loss, expected.loss, 1e-6, f"loss at {length}")
    assert len(captures) == 1


def test_conditions_the_compile_assumed_are_checked():
    """A condition a rule assumed of a symbol (here by hand: the sequence is even) refuses a call
    that breaks it, naming the condition and the fix."""
    s = sympy.Symbol("s0", positive=True, integer=True)
    dynamic = DynamicShapes({0: (sympy.Integer(4), s)}, [(sympy.Integer(4), s)], {s: (1, None)},
                            [sympy.Eq(sympy.Mod(s, 2), 0)], {s: "dim 1 of positional input 0"})
    mesh = Mesh(2, 1)
    names = ["positional input 0"]
    assert dynamic.bind({0: torch.zeros(4, 6)}, names, mesh) == {s: 6}
    with pytest.raises(ValueError, match=r"compiled assuming Eq\(Mod\(s0, 2\), 0\) .*\(dim 1 of positional input 0 = 7\)"):
        dynamic.bind({0: torch.zeros(4, 7)}, names, mesh)


def _gloo_worker(rank, world_size):
    """Every length on [2, 2, 1] and 1-D p=4 over gloo, one compile each; the largest error."""
    torch.set_num_threads(1)
    worst, compiles = 0.0, []
    for q, d, mode in ((2, 1, "2.5d"), (2, 1, "1d")):
        model = tiny_gpt()
        with counting_captures() as captures:
            sharded = tess_compile.shard(copy.deepcopy(model), q, d, example_inputs=(torch.randint(0, VOCAB, (4, 12)),),
                                         mode=mode, dynamic=True, timeout=60)
            for length in LENGTHS:
                torch.manual_seed(length)
                ids = torch.randint(0, VOCAB, (4, length))
                expected, actual = model(ids), sharded(ids)
                expected.square().sum().backward()
                actual.square().sum().backward()  # a DTensor: its sum is the global sum
                pairs = [(actual.full_tensor(), expected)]
                grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
                pairs += [(grads[name], p.grad) for name, p in model.named_parameters()]
                worst = max(worst, *(((a - e).abs().max() / e.abs().max()).item() for a, e in pairs))
                model.zero_grad()
                sharded.zero_grad()
        compiles.append(len(captures))
    return worst, compiles


@pytest.mark.slow
def test_one_compile_for_every_length_over_gloo():
    for worst, compiles in run_local(_gloo_worker, 4, timeout_s=300):
        assert compiles == [1, 1]
        assert worst < 1e-12


@pytest.mark.slow
def test_inductor_compiles_a_dynamic_program_once():
    """compile=True: inductor compiles each rank's program symbolic in batch and sequence, once for every
    size of 2 or more; a sequence of one gets code of its own, as under Dynamo (its 0/1 specialisation)."""
    model = tiny_gpt()
    sharded = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(torch.randint(0, VOCAB, (8, 6)),),
                                    dynamic=True, compile=True)
    for batch, length in ((8, 6), (8, 9), (16, 13), (8, 1)):
        check_call(model, sharded, torch.randint(0, VOCAB, (batch, length)), f"inductor, {batch} x {length}")
    compiled, = sharded._compiled.values()
    assert compiled.compiles() == 2


def test_the_dump_names_the_symbolic_dims():
    text = tess_compile.dump(tiny_gpt(), 2, 2, example_inputs=(torch.randint(0, VOCAB, (8, 12)),), dynamic=True)
    assert re.search(r"# dynamic shapes: positional input 0 \[4\*s\d+, s\d+\] \(every figure and local shape here "
                     r"at the example's sizes\)", text)


def test_where_dynamic_is_refused():
    assert callable(tess_compile.backend(2, 1, dynamic=True))  # the backend takes it: tests/test_backend.py
    with pytest.raises(ValueError, match="dynamic=True is not supported for pipeline stages yet .* dynamic=False"):
        compile_model(tiny_gpt(), Mesh(2, 1), (torch.randint(0, VOCAB, (2, 6)),), dynamic=True, local_inputs=True)
