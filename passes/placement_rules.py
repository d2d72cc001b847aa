"""Placement rules: the table of the place pass, one rule per op, assembled
from the op families in `passes/rules/` (one file each; the rule contract
and shared helpers are in `passes/rules/common.py`).

Conventions: activations `[b, s, h]` are `S(0)S(0)S(2)`; weights of
`x @ W` are split over row (in features) and col (out features) and
replicated over depth; norm/bias vectors are split over col.
"""

from __future__ import annotations

from passes.rules.attention import ATTENTION_RULES
from passes.rules.complex_numbers import COMPLEX_RULES
from passes.rules.convolutions import CONVOLUTION_RULES
from passes.rules.embeddings import EMBEDDING_RULES
from passes.rules.experts import EXPERT_RULES
from passes.rules.factories import FACTORY_RULES
from passes.rules.losses import LOSS_RULES
from passes.rules.norms import NORM_RULES
from passes.rules.pointwise import POINTWISE_RULES
from passes.rules.pooling import POOLING_RULES
from passes.rules.products import PRODUCT_RULES
from passes.rules.reductions import REDUCTION_RULES
from passes.rules.views import VIEW_RULES

__all__ = ["PLACEMENT_RULES", "RULE_FAMILIES"]

# Each family's table by its file's name; no op is in two families.
RULE_FAMILIES = {
    "pointwise": POINTWISE_RULES,
    "reductions": REDUCTION_RULES,
    "views": VIEW_RULES,
    "factories": FACTORY_RULES,
    "products": PRODUCT_RULES,
    "attention": ATTENTION_RULES,
    "embeddings": EMBEDDING_RULES,
    "losses": LOSS_RULES,
    "norms": NORM_RULES,
    "convolutions": CONVOLUTION_RULES,
    "complex_numbers": COMPLEX_RULES,
    "experts": EXPERT_RULES,
    "pooling": POOLING_RULES,
}

PLACEMENT_RULES = {op: rule for family in RULE_FAMILIES.values() for op, rule in family.items()}
