"""The rule tables of the compiler, assembled from the op families, one file each.

Each family's file (`passes/rules/<family>.py`) holds, for the ops of that
family, its placement rules, its lowering rules and, where mode "1d"
(Megatron-LM) differs, those of mode "1d", in one `Family` (the products
family keeps its mode "1d" placement in `products_1d.py` and which rows of
an input each rank takes in `product_rows.py`, which only `products.py`
imports); the contracts are in `passes/rules/family.py`, the helpers they
share in `passes/rules/common.py`.
A new op's rules go into its family's file; a new family's file is added to
`FAMILIES` below. No op is in two families. The families: `pointwise`,
`reductions`, `views`, `factories`, `products` (with `products_1d` and
`product_rows`), `attention`, `embeddings`, `losses`, `norms`, `convolutions`,
`complex_numbers`, `experts`, `pooling`, `indexing`, `sizes`, `einsum`,
`scans` (prefix sums and shifts along a split dim), `view_aliases`
(`tensor_split`, `view_as`, `reshape_as`) and `fourier` (FFTs); the
checks the rules share: which ops take uneven splits (`uneven`) and index
ranges (`index_checks`).

`placement_rules(mode)` is the table of the place pass, `lowering_rules(mode)`
that of the rewrite pass; `family_of(op)` names the family whose rule decided
an op (for the verifier's messages). A family's rule that needs another family's
rule takes it from the table too (`placement_rule`, which the place pass hands the
rules as `PlacementContext.rule`), never from the other family's file: no family
imports another.
"""

from __future__ import annotations

from tess_compile.passes.rules import (
    attention,
    complex_numbers,
    convolutions,
    einsum,
    embeddings,
    experts,
    factories,
    fourier,
    indexing,
    losses,
    norms,
    pointwise,
    pooling,
    products,
    reductions,
    scans,
    sizes,
    view_aliases,
    views,
)
from tess_compile.passes.rules.family import Family

__all__ = ["FAMILIES", "family_of", "lowering_rules", "placement_rule", "placement_rules"]

FAMILIES: tuple[Family, ...] = tuple(module.FAMILY for module in (
    pointwise, reductions, views, factories, products, attention, embeddings, losses, norms, convolutions,
    complex_numbers, experts, pooling, indexing, sizes, einsum, scans, view_aliases, fourier,
))


def _table(name: str, override_1d: str | None) -> dict:
    table = {op: rule for family in FAMILIES for op, rule in getattr(family, name).items()}
    if override_1d is not None:
        table.update({op: rule for family in FAMILIES for op, rule in getattr(family, override_1d).items()})
    return table


_PLACEMENT = {"2d": _table("placement", None), "1d": _table("placement", "placement_1d")}
_LOWERING = {"2d": _table("lowering", None), "1d": _table("lowering", "lowering_1d")}


def placement_rules(mode: str) -> dict:
    """`{op: placement rule}` of `mode` (a mesh's mode)."""
    return _PLACEMENT["1d" if mode == "1d" else "2d"]


def placement_rule(mode: str, op, families: tuple[str, ...]):
    """The placement rule of `op` in `mode`'s table if one of `families` holds `op`, else None."""
    return placement_rules(mode).get(op) if family_of(op) in families else None


def lowering_rules(mode: str) -> dict:
    """`{op: lowering rule}` of `mode`; an op without one runs as it is (`common.lower_default`)."""
    return _LOWERING["1d" if mode == "1d" else "2d"]


def family_of(op) -> str | None:
    """The name of the family whose rules hold `op`, or None."""
    return next((family.name for family in FAMILIES if op in family.placement or op in family.placement_1d), None)
