"""Stage 2a, causal convs: over a token split, a conv1d padded by k-1 whose one user keeps its first L
outputs becomes one `causal_conv1d` node (`tess_compile.ops.causal_conv`), before placement.

Mamba's, Mamba2's and linear attention's causal conv (transformers' `causal_conv1d_fn`,
`nn.Conv1d(C, C, k, groups=C, padding=k-1)(x)[..., :L]` on `[b, C, L]`) is captured as a conv padded
by k-1 on both sides and a slice of its first L outputs. Its middle value, `L + k - 1` long, is no
split of the tokens, so the conv would make them whole on every rank of the token axes. As one node
it is placed as a conv whose tokens keep their split (`passes/rules/convolutions.py`): each rank
convolves its block with the k-1 tokens before it.

The pair is fused where the conv is a 1-D `conv1d` or `convolution` (not transposed) of a 3-D input
with stride 1, dilation 1 and padding k-1 (the kernel's size less one), and its only user is a slice
of the last dim from 0, step 1, as long as the input. Any other conv is left as it is. The fused node
takes the conv's `meta` (its source line, its regions) and the slice's value.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from tess_compile.ops.causal_conv import causal_conv1d

__all__ = ["fuse_causal_convs"]

aten = torch.ops.aten
# The positions of (stride, padding, dilation, groups) in each conv's schema, and their defaults.
_POSITIONS = {aten.conv1d.default: (3, 4, 5, 6), aten.convolution.default: (3, 4, 5, 8)}
_DEFAULTS = ([1], [0], [1], 1)
_NAMES = ("stride", "padding", "dilation", "groups")


def fuse_causal_convs(gm: GraphModule) -> GraphModule:
    """`gm` with each causal conv and its slice as one `causal_conv1d` node (module docstring)."""
    graph = gm.graph
    for conv in list(graph.nodes):
        groups = _causal_groups(conv)
        if groups is None:
            continue
        (cut,) = conv.users
        x, weight = conv.args[:2]
        bias = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
        with graph.inserting_before(cut):
            fused = graph.call_function(causal_conv1d, (x, weight, bias, groups))
        fused.meta = {**conv.meta, "val": cut.meta["val"]}
        cut.replace_all_uses_with(fused)
        graph.erase_node(cut)
        graph.erase_node(conv)
    gm.recompile()
    return gm


def _causal_groups(conv: Node) -> int | None:
    """The groups of `conv` if it is a causal conv with its slice (module docstring), else None."""
    positions = _POSITIONS.get(conv.target) if conv.op == "call_function" else None
    if positions is None or len(conv.users) != 1:
        return None
    if conv.target is aten.convolution.default and conv.args[6]:
        return None  # transposed
    x, weight = (arg.meta.get("val") for arg in conv.args[:2])
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or weight.dim() != 3:
        return None
    stride, padding, dilation, groups = (
        conv.args[i] if len(conv.args) > i else conv.kwargs.get(name, default)
        for i, name, default in zip(positions, _NAMES, _DEFAULTS))
    if _ints(stride) != [1] or _ints(dilation) != [1] or _ints(padding) != [weight.shape[-1] - 1]:
        return None
    (cut,) = conv.users
    if cut.target is not aten.slice.Tensor or cut.kwargs:
        return None
    dim, start, _, step = (list(cut.args[1:]) + [0, None, None, 1][len(cut.args) - 1:])[:4]
    taken = cut.meta.get("val")
    if dim % 3 != 2 or start not in (0, None) or step != 1 or taken is None or taken.shape[-1] != x.shape[-1]:
        return None
    return groups


def _ints(value) -> list:
    """A conv's stride, padding or dilation as a list (one int stands for every dim)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
