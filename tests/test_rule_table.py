"""The rule tables are assembled from the op families in passes/rules/: each family's
file holds its ops' placement, lowering and mode-1d rules in one `Family`, and each
op is in exactly one family."""

from __future__ import annotations

import importlib

import torch

from tess_compile.passes.rules import FAMILIES, family_of, lowering_rules, placement_rules

aten = torch.ops.aten


def test_families_are_disjoint_and_make_the_tables():
    ops = [op for family in FAMILIES for op in family.placement]
    assert len(ops) == len(set(ops)), [op for op in set(ops) if ops.count(op) > 1]
    assert set(ops) == set(placement_rules("2.5d")) == set(placement_rules("1d"))
    lowered = [op for family in FAMILIES for op in family.lowering]
    assert len(lowered) == len(set(lowered)) and set(lowered) == set(lowering_rules("2.5d"))


def test_each_family_lowers_and_overrides_only_its_own_ops():
    for family in FAMILIES:
        own = set(family.placement)
        for table in (family.lowering, family.placement_1d, family.lowering_1d):
            assert set(table) <= own, (family.name, set(table) - own)


def test_mode_1d_takes_its_own_rules_where_a_family_has_them():
    products = next(family for family in FAMILIES if family.name == "products")
    for op, rule in products.placement_1d.items():
        assert placement_rules("1d")[op] is rule and placement_rules("2.5d")[op] is products.placement[op]
    assert lowering_rules("1d")[aten.linear.default] is products.lowering_1d[aten.linear.default]


def test_an_op_is_found_by_its_family():
    assert family_of(aten.add.Tensor) == "pointwise"
    assert family_of(aten.view.default) == "views"
    assert family_of(aten.linear.default) == "products"
    assert family_of(aten.scaled_dot_product_attention.default) == "attention"
    assert family_of(aten.layer_norm.default) == "norms"
    assert family_of(aten.embedding.default) == "embeddings"
    assert family_of(aten.conv2d.default) == "convolutions"
    assert family_of(aten.flip.default) is None


def test_each_family_is_its_own_documented_module():
    for family in FAMILIES:
        module = importlib.import_module(f"tess_compile.passes.rules.{family.name}")
        assert module.__doc__ and module.__doc__.isascii(), family.name
        assert module.FAMILY is family, family.name
