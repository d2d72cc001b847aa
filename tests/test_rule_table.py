"""The placement table is assembled from the op families in passes/rules/: each
op has one rule, found in exactly one family."""

from __future__ import annotations

import importlib

import torch

from passes.megatron_rules import PLACEMENT_RULES_1D
from passes.placement_rules import PLACEMENT_RULES, RULE_FAMILIES

aten = torch.ops.aten


def test_families_are_disjoint_and_make_the_table():
    ops = [op for family in RULE_FAMILIES.values() for op in family]
    assert len(ops) == len(set(ops)), [op for op in set(ops) if ops.count(op) > 1]
    assert set(ops) == set(PLACEMENT_RULES)
    assert set(PLACEMENT_RULES_1D) == set(PLACEMENT_RULES)


def test_an_op_is_found_by_its_family():
    family_of = {op: name for name, family in RULE_FAMILIES.items() for op in family}
    assert family_of[aten.add.Tensor] == "pointwise"
    assert family_of[aten.view.default] == "views"
    assert family_of[aten.linear.default] == "products"
    assert family_of[aten.scaled_dot_product_attention.default] == "attention"
    assert family_of[aten.layer_norm.default] == "norms"
    assert family_of[aten.embedding.default] == "embeddings"
    assert family_of[aten.conv2d.default] == "convolutions"


def test_each_family_is_its_own_documented_module():
    for name, family in RULE_FAMILIES.items():
        module = importlib.import_module(f"passes.rules.{name}")
        assert module.__doc__ and module.__doc__.isascii(), name
        tables = [value for key, value in vars(module).items() if key.endswith("_RULES")]
        assert tables == [family], name
