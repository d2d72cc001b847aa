"""The architecture zoo under bfloat16 autocast, as its users train with it: every model of
`benchmarks/architectures.py` in float32, compiled and called under
`torch.autocast("cpu", dtype=torch.bfloat16)` on `[2, 2, 1]` (the fuzzer's autocast mode compiles
outside autocast and calls under it).

Its logits and loss take the unsharded model's dtypes under the same autocast, every gradient its
dtype and finiteness, and the loss is as close to the float64 model's as the unsharded model's
(at most twice its error plus 1e-2: bfloat16 keeps 8 bits, and a norm over a batch split over ranks
sums in another order; MobileNetV2's sharded loss is closer than the unsharded one).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import tess_compile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.architectures import ARCHITECTURES, build

pytestmark = pytest.mark.slow


def _float32(value):
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _call(module, inputs):
    return module(**inputs) if isinstance(inputs, dict) else module(*inputs)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_under_autocast(name):
    library = ARCHITECTURES[name].library
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    case = build(name, "default")
    truth = case.loss(_call(copy.deepcopy(case.model), case.inputs)).item()
    model, inputs = case.model.float(), pytree.tree_map(_float32, case.inputs)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        sim = tess_compile.simulate(copy.deepcopy(model), 2, 1, example_inputs=inputs)  # the autocast program
        torch.manual_seed(0)
        out = _call(sim, inputs)
        torch.manual_seed(0)
        ref = _call(model, inputs)
        loss, ref_loss = case.loss(out), case.loss(ref)
    logits, ref_logits = getattr(out, "logits", out), getattr(ref, "logits", ref)
    assert (logits.dtype, loss.dtype) == (ref_logits.dtype, ref_loss.dtype)
    error, ref_error = abs(loss.item() - truth) / abs(truth), abs(ref_loss.item() - truth) / abs(truth)
    assert error <= 2 * ref_error + 1e-2, f"loss error {error:.2e}, unsharded {ref_error:.2e}"
    loss.backward()
    ref_loss.backward()
    grads = sim.full_grads()
    for param_name, param in model.named_parameters():
        if param.grad is not None:
            grad = grads[param_name]
            assert grad is not None and grad.dtype == param.grad.dtype, param_name
            assert torch.isfinite(grad[torch.isfinite(param.grad)]).all(), param_name
