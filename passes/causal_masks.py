"""Causal masks a model builds from its sizes alone, given to attention as `is_causal` (part of capture).

transformers builds its attention mask in the graph and, when tracing, never
takes `scaled_dot_product_attention`'s `is_causal` shortcut: the captured
graph materializes a [.., L, S] mask from `arange`s and comparisons, and
torch's attention kernel takes it as a float mask, kept for backward. That is
L x S floats held per rank and step (16 MiB at 2,048 tokens, 256 MiB at 8,192)
that the model as users run it never makes, and on a token split a mask to
cut by query rows and gather by key blocks.

A `scaled_dot_product_attention` whose `attn_mask` reads no input's values (it
is computed from factories and sizes only: no placeholder among its
producers) is evaluated once here, on the CPU. Where it is the causal mask
(`is_causal`'s: query i attends keys 0..i, top-left aligned; True or 0.0
where attended, False or a value no larger than the dtype's lowest half where
not) for every batch and head it broadcasts over, the call takes
`is_causal=True` and no mask. The output is the same to rounding (a masked
score's weight is 0 either way). Left as they are: masks of symbolic sizes, of
more than `MAX_EVALUATED` elements, reading an input (a padding mask), and any
other pattern (a sliding window, a cache's bottom-right alignment).

A mask that reads an input but is the causal mask AND something else (transformers' causal mask and
its padding mask, joined by `&`) keeps its mask and is marked `CAUSAL_BOUNDED` (`is_causal` reads
it): no query attends a key in its future, which context attention may then skip, as under
`is_causal`. The bound is evaluated, not matched: the mask's producers are run with every value
read from an input taken as True (all attended), through ANDs and ops that only move values
(`_MOVES`), and the result must mask every key after its query.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate

from tess_compile.core.meta_keys import CAUSAL_BOUNDED

__all__ = ["MAX_EVALUATED", "causal_masks_as_flags", "is_causal"]

log = logging.getLogger("tess_compile")

aten = torch.ops.aten
MAX_EVALUATED = 1 << 28  # mask elements evaluated at compile time at most (a 16,384-token causal mask)
_SDPA = aten.scaled_dot_product_attention.default
_MASK, _IS_CAUSAL = 3, 5  # positions of attn_mask and is_causal in SDPA's schema
# Bool ops whose value is no larger than each operand's (an AND), and ops that only move values.
_ANDS = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default, aten.mul.Tensor}
_MOVES = {aten.expand.default, aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.permute.default,
          aten.transpose.int, aten.clone.default, aten.alias.default, aten.to.dtype_layout, aten.to.dtype,
          aten.to.device, aten._to_copy.default, aten.contiguous.default, aten.slice.Tensor, aten.select.int}


def causal_masks_as_flags(gm: GraphModule) -> GraphModule:
    """Each SDPA of `gm` whose mask is computed from sizes alone and is the causal mask takes
    `is_causal=True` instead, and one whose mask is bounded by the causal mask is marked
    `CAUSAL_BOUNDED` (module docstring); the masks' nodes are left for dead-code removal."""
    done = bounded = 0
    masks = _MaskValues(gm.graph)  # the layers of a model share one mask: worked out once
    for node in gm.graph.find_nodes(op="call_function", target=_SDPA):
        mask = _arg(node, _MASK, "attn_mask")
        if not isinstance(mask, Node) or _arg(node, _IS_CAUSAL, "is_causal"):
            continue
        if _is_causal_mask(node, mask, masks):
            kwargs = {name: value for name, value in node.kwargs.items() if name not in ("attn_mask", "is_causal")}
            if len(node.args) > 4:
                kwargs["dropout_p"] = node.args[4]
            node.args, node.kwargs = node.args[:3], {**kwargs, "is_causal": True}
            done += 1
        elif _bounded_by_causal(node, mask, masks):
            CAUSAL_BOUNDED.set(node, True)
            bounded += 1
    if done:
        log.info("capture: %d attention mask(s) built from sizes alone are causal: is_causal=True", done)
    if bounded:
        log.info("capture: %d attention mask(s) read an input but are the causal mask and more: context "
                 "attention skips each query's future keys", bounded)
    return gm


def is_causal(sdpa: Node) -> bool:
    """Whether no query of the attention `sdpa` attends a key after it: `is_causal`, or a mask bounded
    by the causal one (`CAUSAL_BOUNDED`)."""
    return bool(_arg(sdpa, _IS_CAUSAL, "is_causal", False)) or bool(CAUSAL_BOUNDED.get(sdpa, False))


def _arg(node: Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _evaluable_sizes(sdpa: Node, mask: Node) -> bool:
    """Whether the attention's queries, keys and mask have static sizes, the mask of at most
    `MAX_EVALUATED` elements and two dims or more."""
    query, key = (sdpa.args[i].meta.get("val") for i in (0, 1))
    value = mask.meta.get("val")
    if any(not isinstance(t, torch.Tensor) or not all(isinstance(s, int) for s in t.shape)
           for t in (query, key, value)):
        return False
    return value.numel() <= MAX_EVALUATED and value.dim() >= 2


def _bounded_by_causal(sdpa: Node, mask: Node, masks: _MaskValues) -> bool:
    """Whether the bool `mask` of the self-attention `sdpa` masks every key after its query, whatever
    the inputs it reads hold (module docstring)."""
    query, key = (sdpa.args[i].meta.get("val") for i in (0, 1))
    if not _evaluable_sizes(sdpa, mask) or mask.meta["val"].dtype != torch.bool or query.shape[-2] != key.shape[-2]:
        return False
    return masks.bounded_by_causal(mask, query.shape[-2])


def _is_causal_mask(sdpa: Node, mask: Node, masks: _MaskValues) -> bool:
    """Whether `mask`, evaluated, is the causal mask of the attention `sdpa` for every batch and head."""
    query, key = (sdpa.args[i].meta.get("val") for i in (0, 1))
    return _evaluable_sizes(sdpa, mask) and masks.is_causal(mask, query.shape[-2], key.shape[-2])


class _MaskValues:
    """What the nodes that make a graph's attention masks tell, each worked out once (a model's layers
    share one mask): a node's value (`value`), whether it is the causal mask (`is_causal`), the largest
    value a bool node takes whatever the inputs hold (`upper_bound`), and whether that masks every
    future key (`bounded_by_causal`)."""

    def __init__(self, graph: Graph):
        self._position = {node: i for i, node in enumerate(graph.nodes)}.__getitem__
        self._values: dict[Node, torch.Tensor | None] = {}
        self._bounds: dict[Node, torch.Tensor | None] = {}
        self._causal: dict[tuple, bool] = {}  # (mask, queries, keys or None: bounded) -> verdict

    def value(self, node: Node) -> torch.Tensor | None:
        """`node`'s value from its producers, run on the CPU; None if any producer is an input (its value
        is not known here) or is not an op."""
        if node not in self._values:
            self._values[node] = self._evaluated(node)
        return self._values[node]

    def is_causal(self, mask: Node, queries: int, keys: int) -> bool:
        """Whether `mask`'s value is the causal mask of `queries` x `keys` for every batch and head."""
        key = (mask, queries, keys)
        if key not in self._causal:
            self._causal[key] = self._causal_value(self.value(mask), queries, keys)
        return self._causal[key]

    def bounded_by_causal(self, mask: Node, tokens: int) -> bool:
        """Whether the bool `mask`'s upper bound is `tokens` x `tokens` and masks every key after its query."""
        key = (mask, tokens, None)
        if key not in self._causal:
            upper = self.upper_bound(mask)
            future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
            self._causal[key] = (upper is not None and upper.shape[-2:] == (tokens, tokens)
                                 and not bool(upper[..., future].any()))
        return self._causal[key]

    @staticmethod
    def _causal_value(evaluated: torch.Tensor | None, queries: int, keys: int) -> bool:
        if evaluated is None or evaluated.shape[-2:] != (queries, keys):
            return False
        attended = torch.ones(queries, keys, dtype=torch.bool).tril()
        if evaluated.dtype == torch.bool:
            return bool((evaluated == attended).all())
        lowest = torch.finfo(evaluated.dtype).min / 2
        return bool(((evaluated == 0) == attended).all() and (evaluated[..., ~attended] <= lowest).all())

    def _evaluated(self, mask: Node) -> torch.Tensor | None:
        order, seen, stack = [], set(), [mask]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            if node.op != "call_function":
                return None
            seen.add(node)
            order.append(node)
            stack.extend(node.all_input_nodes)
        values: dict[Node, object] = {}
        cpu = torch.device("cpu")
        for node in sorted(order, key=self._position):
            args, kwargs = map_aggregate((node.args, node.kwargs), lambda a: values[a] if isinstance(a, Node)
                                         else cpu if isinstance(a, torch.device) else a)
            values[node] = node.target(*args, **kwargs)
        return values[mask]

    def upper_bound(self, node: Node) -> torch.Tensor | None:
        """The largest value the bool `node` takes over all inputs (True wherever it reads an input
        through ANDs and moves), or None where it is not such a node."""
        if node not in self._bounds:
            self._bounds[node] = None
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and value.dtype == torch.bool and node.op == "call_function":
                self._bounds[node] = self._bound_of(node)
        return self._bounds[node]

    def _bound_of(self, node: Node) -> torch.Tensor | None:
        known = self.value(node)
        if known is not None:
            return known
        if node.target in _ANDS:
            operands = [self._operand_bound(a) for a in node.args[:2]]
            return None if None in operands else operands[0] & operands[1]
        if node.target in _MOVES and isinstance(node.args[0], Node):
            moved = self.upper_bound(node.args[0])
            return None if moved is None else self._replay(node, moved)
        return None

    def _operand_bound(self, operand) -> torch.Tensor | None:
        """The largest value of an AND's bool `operand`: its upper bound, all True where it has none
        (it reads an input); None where it is no bool tensor of static sizes."""
        if not isinstance(operand, Node):
            return torch.tensor(operand) if isinstance(operand, bool) else None
        value = operand.meta.get("val")
        if (not isinstance(value, torch.Tensor) or value.dtype != torch.bool
                or not all(isinstance(s, int) for s in value.shape)):
            return None
        bound = self.upper_bound(operand)
        return torch.ones(value.shape, dtype=torch.bool) if bound is None else bound

    def _replay(self, node: Node, first: torch.Tensor) -> torch.Tensor | None:
        """`node`'s op on `first` in place of its first argument (its other arguments evaluated), on
        the CPU; None where another argument reads an input."""
        rest = [(self.value(a) if isinstance(a, Node) else a) for a in node.args[1:]]
        if any(r is None and isinstance(a, Node) for r, a in zip(rest, node.args[1:])):
            return None
        cpu = torch.device("cpu")
        args, kwargs = map_aggregate(((first, *rest), node.kwargs), lambda a: cpu if isinstance(a, torch.device) else a)
        return node.target(*args, **kwargs)
