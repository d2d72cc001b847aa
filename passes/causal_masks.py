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
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

__all__ = ["MAX_EVALUATED", "causal_masks_as_flags"]

log = logging.getLogger("tess_compile")

aten = torch.ops.aten
MAX_EVALUATED = 1 << 28  # mask elements evaluated at compile time at most (a 16,384-token causal mask)
_SDPA = aten.scaled_dot_product_attention.default
_MASK, _IS_CAUSAL = 3, 5  # positions of attn_mask and is_causal in SDPA's schema


def causal_masks_as_flags(gm: GraphModule) -> GraphModule:
    """Each SDPA of `gm` whose mask is computed from sizes alone and is the causal mask takes
    `is_causal=True` instead (module docstring); the mask's nodes are left for dead-code removal."""
    done = 0
    for node in gm.graph.find_nodes(op="call_function", target=_SDPA):
        mask = _arg(node, _MASK, "attn_mask")
        if not isinstance(mask, Node) or _arg(node, _IS_CAUSAL, "is_causal") or not _is_causal_mask(node, mask):
            continue
        kwargs = {name: value for name, value in node.kwargs.items() if name not in ("attn_mask", "is_causal")}
        if len(node.args) > 4:
            kwargs["dropout_p"] = node.args[4]
        node.args, node.kwargs = node.args[:3], {**kwargs, "is_causal": True}
        done += 1
    if done:
        log.info("capture: %d attention mask(s) built from sizes alone are causal: is_causal=True", done)
    return gm


def _arg(node: Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _is_causal_mask(sdpa: Node, mask: Node) -> bool:
    """Whether `mask`, evaluated, is the causal mask of the attention `sdpa` for every batch and head."""
    query, key = (sdpa.args[i].meta.get("val") for i in (0, 1))
    value = mask.meta.get("val")
    if any(not isinstance(t, torch.Tensor) or not all(isinstance(s, int) for s in t.shape)
           for t in (query, key, value)):
        return False
    if value.numel() > MAX_EVALUATED or value.dim() < 2:
        return False
    evaluated = _evaluate(mask)
    if evaluated is None:
        return False
    attended = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
    if evaluated.shape[-2:] != attended.shape:
        return False
    if evaluated.dtype == torch.bool:
        return bool((evaluated == attended).all())
    lowest = torch.finfo(evaluated.dtype).min / 2
    return bool(((evaluated == 0) == attended).all() and (evaluated[..., ~attended] <= lowest).all())


def _evaluate(mask: Node) -> torch.Tensor | None:
    """`mask`'s value from its producers, run on the CPU; None if any producer is an input (its value is
    not known here) or is not an op."""
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
    for node in sorted(order, key=_position(mask.graph)):
        args, kwargs = map_aggregate((node.args, node.kwargs), lambda a: values[a] if isinstance(a, Node)
                                     else cpu if isinstance(a, torch.device) else a)
        values[node] = node.target(*args, **kwargs)
    return values[mask]


def _position(graph) -> Callable[[Node], int]:
    index = {node: i for i, node in enumerate(graph.nodes)}
    return index.__getitem__
