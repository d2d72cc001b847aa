"""The matrix products of the per-rank graph: one record per product op, everything about it in one place.

A `ProductKernel` holds an ATen product op, the role of each of its operands, the dim of a 2-D weight
that gives the output's last dim, its shape rule, its local kernel with the two gradients a fetched
product computes, and which passes apply to it. Its placement and lowering rules stay in its rule
family's file (`passes/rules/products.py`); every other consumer reads `PRODUCT_KERNELS` when it
meets an op (`product_kernel`), so a new record is seen everywhere at once:

- `passes/place.py` lets a hint split the output features of a `groupable` product in groups (a
  fused QKV's);
- `passes/summa.py` runs each step of a SUMMA product as a `fetched_product` of its kernel (`summa`),
  which `tess_compile/ops/fetched_product.py` computes (`forward`, `grad_input`, `grad_weight`, and
  `join` for a merged weight's pieces);
- `passes/merge_products.py` merges the products of one input (`merges`: the operand roles and
  `out_dim` say where the input, the weight and the bias are and how the weights concatenate);
- `passes/recompute_selective.py` saves a product's output (`saved`) rather than recomputing it;
- `tess_compile/analysis/symbolic_shapes.py` derives a product's local shape (`shape`).

Layer: core, so that the ops, the passes and the analyses read one table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PRODUCT_KERNELS", "ProductKernel", "ShapeRule", "product_kernel"]

aten = torch.ops.aten

# shape(input, weight, broadcast) -> the output's shape, or None where the rule does not apply: the shapes of
# the input and weight operands (tuples of sizes or symbols); `broadcast(shapes)` joins batch dims, None if
# they do not broadcast.
ShapeRule = Callable[[tuple, tuple, Callable[[Sequence[tuple]], tuple | None]], tuple | None]


@dataclass(frozen=True)
class ProductKernel:
    """One product op: its operands, its out dim, its shape rule, its kernel, and the passes that apply.

    `operands` names the role of each positional argument: "input" (the first factor, whose last
    dim is the one contracted), "weight" (the second factor: a weight where SUMMA multiplies by
    one, another activation in a batched product), "bias". `out_dim` is the dim of a 2-D weight
    that is the output's last dim (linear's [out, in]: 0; matmul's [in, out]: 1). `forward(a, w)`,
    `grad_input(grad, w)` and `grad_weight(grad, a)` are the local kernel and its gradients on
    blocks, for a kernel that SUMMA runs (`summa`).
    """

    name: str
    op: torch._ops.OpOverload
    operands: tuple[str, ...]
    out_dim: int | None = None
    shape: ShapeRule | None = None
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    grad_input: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    grad_weight: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    summa: bool = False  # SUMMA's steps run this kernel (`passes/summa.py`, a `fetched_product` of its name)
    merges: bool = False  # the products of one input merge into one of their concatenated weights
    saved: bool = True  # selective recompute keeps its output
    groupable: bool = False  # a hint may split its output features in groups (`passes/place.py`)

    def __post_init__(self) -> None:
        if self.summa or self.merges:  # fetched_product runs the kernel; a merged product is one of its calls
            assert self.forward and self.grad_input and self.grad_weight and self.out_dim is not None, self.name
        if self.merges:  # merge_products calls the op on (input, weight) as its first arguments
            assert self.operands[:2] == ("input", "weight"), self.name

    def arg(self, args: Sequence, role: str):
        """The argument of `role` among a call's positional `args` (None if absent)."""
        index = self.operands.index(role) if role in self.operands else len(args)
        return args[index] if index < len(args) else None

    def join(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """A weight's block from the pieces of merged products, concatenated along the out dim."""
        return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), self.out_dim)


def _linear_shape(a: tuple, w: tuple, broadcast) -> tuple:
    return tuple(a[:-1]) + tuple(w[:1])


def _matmul_shape(a: tuple, w: tuple, broadcast) -> tuple | None:
    if len(a) < 2 or len(w) < 2:
        return None
    batch = broadcast([tuple(a[:-2]), tuple(w[:-2])])
    return None if batch is None else batch + (a[-2], w[-1])


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


_RECORDS = (
    ProductKernel("linear", aten.linear.default, ("input", "weight", "bias"), out_dim=0, shape=_linear_shape,
                  forward=F.linear, grad_input=torch.matmul, grad_weight=lambda grad, a: _rows(grad).t() @ _rows(a),
                  summa=True, merges=True, groupable=True),
    ProductKernel("matmul", aten.matmul.default, ("input", "weight"), out_dim=1, shape=_matmul_shape,
                  forward=torch.matmul, grad_input=lambda grad, w: torch.matmul(grad, w.t()),
                  grad_weight=lambda grad, a: _rows(a).t() @ _rows(grad), summa=True, merges=True, groupable=True),
    ProductKernel("mm", aten.mm.default, ("input", "weight"), out_dim=1, shape=_matmul_shape),
    ProductKernel("bmm", aten.bmm.default, ("input", "weight"), shape=_matmul_shape),
    ProductKernel("addmm", aten.addmm.default, ("bias", "input", "weight"), out_dim=1, groupable=True),
    ProductKernel("baddbmm", aten.baddbmm.default, ("bias", "input", "weight")),
)

# name -> its record. The passes look records up when they meet an op (`product_kernel`).
PRODUCT_KERNELS: dict[str, ProductKernel] = {record.name: record for record in _RECORDS}


def product_kernel(target) -> ProductKernel | None:
    """The record of the product op `target` (a graph node's target), or None for any other op."""
    return next((record for record in PRODUCT_KERNELS.values() if record.op == target), None)
