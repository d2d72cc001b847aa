"""The product records (`tess_compile.core.product_table`): one record per product op, read by every
pass and analysis that knows a product by its op.

A toy kernel (a custom op computing `x @ w.T`, its weight [out, in]) added as a record, with the
rules of `aten.linear` as its rules and nothing else, is seen everywhere: SUMMA's steps run it as a
fetched product of its name, its products of one input merge, selective recompute saves it, the
symbolic shapes derive its local shape, the place pass's group hints reach it; the compiled model
equals the unsharded one in float64 (outputs and every gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import assert_close_rel
from torch import nn
from torch.fx import Graph

import tess_compile
from tess_compile.analysis.symbolic import symbolic_bytes
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import RECOMPUTE_REGION
from tess_compile.core.product_table import PRODUCT_KERNELS, ProductKernel, product_kernel
from tess_compile.ops.fetched_product import fetched_product
from tess_compile.passes.place import PlacementContext
from tess_compile.passes.recompute_selective import saves_output
from tess_compile.passes.rules import lowering_rules, placement_rules

aten = torch.ops.aten


@torch.library.custom_op("tess_test::toy_product", mutates_args=())
def toy_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


toy_product.register_fake(lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0]))
toy_product.register_autograd(
    lambda ctx, grad: (grad @ ctx.w, grad.reshape(-1, grad.shape[-1]).t() @ ctx.x.reshape(-1, ctx.x.shape[-1])),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]) or setattr(ctx, "w", inputs[1]))

TOY_OP = torch.ops.tess_test.toy_product.default
TOY = ProductKernel(
    "toy_product", TOY_OP, ("input", "weight"), out_dim=0, shape=PRODUCT_KERNELS["linear"].shape,
    forward=F.linear, grad_input=torch.matmul, grad_weight=PRODUCT_KERNELS["linear"].grad_weight,
    summa=True, merges=True, groupable=True)


class TwoHeads(nn.Module):
    """Two toy products of one input (merged into one), and their sum."""

    def __init__(self, hidden: int = 10):
        super().__init__()
        self.first = nn.Parameter(torch.randn(hidden, hidden))
        self.second = nn.Parameter(torch.randn(hidden, hidden))

    def forward(self, x):
        return toy_product(x, self.first).relu() * toy_product(x, self.second)


def _with_toy(monkeypatch):
    """The toy's record, and `aten.linear`'s rules for it (placement and lowering, in every mode)."""
    monkeypatch.setitem(PRODUCT_KERNELS, TOY.name, TOY)
    for mode in ("2.5d", "1d"):
        for table in (placement_rules(mode), lowering_rules(mode)):
            monkeypatch.setitem(table, TOY_OP, table[aten.linear.default])


def _exact(**options):
    torch.manual_seed(0)
    model = TwoHeads().double()
    x = torch.randn(4, 3, 10, dtype=torch.float64)
    sim = tess_compile.simulate(model, 2, 2, example_inputs=(x,), strict=True, verify=True, **options)
    out, expected = sim(x), model(x)
    assert_close_rel(out, expected, 1e-12, "output")
    out.sum().backward()
    expected.sum().backward()
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        assert_close_rel(grads[name], param.grad, 1e-12, f"grad {name}")
    return sim.program


def test_a_toy_product_kernel_is_seen_everywhere_through_its_record(monkeypatch):
    assert product_kernel(TOY_OP) is None
    _with_toy(monkeypatch)
    assert product_kernel(TOY_OP) is TOY and saves_output(TOY_OP)
    # SUMMA's steps: fetched products of the toy kernel, the two products of x merged into one a step
    program = _exact(summa="broadcast")
    products = [n for n in program.graph.graph.nodes if n.target is fetched_product]
    assert products and {n.args[4] for n in products} == {"toy_product"}
    assert len(products) == 2  # q = 2 steps, each one product of both weights
    # kept blocks: the toy op itself in the per-rank graph, merged, saved by selective recompute, its shape derived
    program = _exact(summa="broadcast", keep_blocks=True, recompute="selective")
    toys = [n for n in program.graph.graph.nodes if n.target is TOY_OP]
    assert len(toys) == 2 and not any(RECOMPUTE_REGION.has(n) for n in toys)
    assert symbolic_bytes(program, {"b": 4, "s": 3, "h": 10})
    # the place pass's group hints (a fused QKV's) reach a groupable product
    graph = Graph()
    node = graph.call_function(TOY_OP, (graph.placeholder("x"), graph.placeholder("w")))
    assert PlacementContext(Mesh(2, 2), {}).want_groups(node, 3)


def test_every_record_reads_its_operands_by_role():
    linear, addmm = PRODUCT_KERNELS["linear"], PRODUCT_KERNELS["addmm"]
    assert [linear.arg(("x", "w"), role) for role in ("input", "weight", "bias")] == ["x", "w", None]
    assert [addmm.arg(("b", "x", "w"), role) for role in ("input", "weight", "bias")] == ["x", "w", "b"]
    for record in PRODUCT_KERNELS.values():
        assert product_kernel(record.op) is record
        assert set(record.operands) <= {"input", "weight", "bias"}
