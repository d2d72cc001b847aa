"""Which token order a captured graph takes over a token split (`CompileOptions.token_order`; the
stripes of `tess_compile.core.row_split.RowSplit`).

A striped order evens causal attention's work out over the ranks of a token split: every rank
holds a block of each of `stripes` equal parts of the sequence, and the queries of part j attend the
keys of parts 0 to j alone (`tess_compile.ops.context_attention`). Every token-wise op runs on its
rows as it does on a contiguous block. An op that reads neighbouring tokens (a prefix sum, a shift
or a roll, a convolution along the tokens, a slice of some of them) cannot keep stripes: it makes its
input whole first (`tess_compile.passes.rules.scans`), where a contiguous split exchanges an edge.

"auto" takes the striped order where the tokens split over the axes of context-parallel attention
(not mode 1d, which gathers the tokens for attention and splits its heads), the model has a causal
self-attention (`is_causal`, which capture gives a causal mask built from sizes, or a mask bounded by
the causal one, such as transformers' causal and padding masks joined: `passes.causal_masks`; either schedule, `context="gather"` or `"ring"`), the sequence splits into stripes (`row_split.stripe_count`), no op reads neighbouring tokens of an
activation (a float tensor of three or more dims: a causal LM's label shift reads integer labels,
cheap to make whole), and no output holds the tokens (outputs leave in one block a rank, so an LM's
logits would be gathered: a training step that returns its loss alone takes stripes). "striped" asks
for it, a ValueError where it cannot be had (outputs that hold tokens are then gathered and cut into
blocks); "contiguous" keeps one block a rank.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from tess_compile.core.mesh import Mesh
from tess_compile.core.options import AUTO, CompileOptions
from tess_compile.core.row_split import RowSplit, stripe_count, token_dim, token_parts
from tess_compile.passes.causal_masks import is_causal
from tess_compile.passes.source_lines import source_line

__all__ = ["with_token_order"]

log = logging.getLogger("tess_compile")

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
# Ops that read the tokens next to a token, or a run of them, when they act along the tokens.
_CONVOLUTIONS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                 aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding}  # capture keeps conv1d (Mamba's)
_NEIGHBOURS = {aten.cumsum.default, aten.cumprod.default, aten.roll.default, aten.constant_pad_nd.default,
               aten.slice.Tensor, *_CONVOLUTIONS}


def with_token_order(gm: GraphModule, rows: RowSplit, options: CompileOptions, mesh: Mesh) -> RowSplit:
    """`rows` with the stripes `options.token_order` gives `gm`'s inputs (module docstring)."""
    if options.token_order == "striped" and rows.tokens == "none":
        raise _refused(mesh, rows, "the tokens do not split")
    if options.token_order == "contiguous" or rows.tokens == "none":
        return rows
    stripes = stripe_count(rows.length, token_parts(rows.tokens, mesh))
    reasons = _reasons(gm, options, stripes, rows, mesh)
    if options.token_order == "striped" and reasons:
        raise _refused(mesh, rows, "; ".join(reasons))
    if reasons:
        log.debug("token order: contiguous on mesh %s (%s)", mesh, "; ".join(reasons))
        return rows
    log.info("token order: %d stripes of %d tokens over %s on mesh %s", stripes, rows.length // stripes,
             rows.tokens, mesh)
    return dataclasses.replace(rows, stripes=stripes)


def _reasons(gm: GraphModule, options: CompileOptions, stripes: int, rows: RowSplit, mesh: Mesh) -> list[str]:
    """Why a striped order does not apply or does not pay (none: it does)."""
    reasons = []
    if stripes == 1:
        parts = token_parts(rows.tokens, mesh)
        reasons.append(f"{rows.length} tokens are not a multiple of 2 x the {parts} ranks that split them")
    if mesh.mode == "1d":
        reasons.append("mode 1d gathers the tokens for attention, whose heads split")
    if options.token_order == AUTO and not any(_causal_self_attention(n) for n in gm.graph.find_nodes(
            op="call_function", target=_SDPA)):
        reasons.append("no causal self-attention to balance")
    if options.token_order == AUTO:
        reasons += _token_outputs(gm, rows.length)
    neighbours = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _NEIGHBOURS
                  and _reads_activation_tokens(n)]
    if neighbours:
        reasons.append(f"{neighbours[0].target} at {source_line(neighbours[0])} reads neighbouring tokens of an "
                       "activation")
    return reasons


def _token_outputs(gm: GraphModule, length: int) -> list[str]:
    """Why stripes would not pay for the outputs: an output that holds the tokens leaves in one block a
    rank (DTensor's `Shard`; its `_StridedShard` over two mesh dims does not redistribute), which from
    stripes gathers it whole first (an LM's logits)."""
    (output,) = gm.graph.find_nodes(op="output")
    leaves = [leaf for leaf in pytree.tree_leaves(output.args[0]) if isinstance(leaf, Node)]
    held = [index for index, leaf in enumerate(leaves) if token_dim(leaf.meta.get("val"), length) is not None]
    return [f"output {held[0]} holds the tokens (it leaves in one block a rank)"] if held else []


def _causal_self_attention(node: Node) -> bool:
    """Whether `node` is a self-attention under a causal mask (`is_causal`, or a mask bounded by it)."""
    query, key = (arg.meta.get("val") for arg in node.args[:2])
    return is_causal(node) and query is not None and key is not None and query.shape[-2] == key.shape[-2]


def _reads_activation_tokens(node: Node) -> bool:
    """Whether `node` reads neighbouring entries of dim 1 (where a `[b, s, h]` activation holds its
    tokens) of a float tensor of three or more dims; a convolution, of any such input."""
    x = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 3:
        return False
    return node.target in _CONVOLUTIONS or 1 in _dims_read(node, x)


def _dims_read(node: Node, x: torch.Tensor) -> set[int]:
    """The dims along which `node` (a prefix product or sum, a roll, a pad, a slice) reads neighbours."""
    args = list(node.args) + [None] * 4
    if node.target in (aten.cumsum.default, aten.cumprod.default):
        return {args[1] % x.dim()}
    if node.target is aten.roll.default:
        dims = args[2] or node.kwargs.get("dims") or ()
        return {d % x.dim() for d in dims} if dims else set(range(x.dim()))  # no dims: the flattened tensor
    if node.target is aten.constant_pad_nd.default:
        pad = list(args[1])
        return {x.dim() - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}
    dim, start, end, step = (args[1] or 0) % x.dim(), args[2] or 0, args[3], args[4] or 1
    whole = start == 0 and step == 1 and (end is None or end >= x.shape[dim])
    return set() if whole else {dim}


def _refused(mesh: Mesh, rows: RowSplit, why: str) -> ValueError:
    return ValueError(f"token_order='striped' on mesh {mesh} ({rows}): {why}; use token_order='auto' or "
                      "'contiguous'")
