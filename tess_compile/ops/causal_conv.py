"""The causal conv1d as one graph target: `conv1d(x, weight, bias, padding=k-1, groups=groups)[..., :L]`,
each output position the conv of its input and the k-1 before it (zeros before the first), the token
mixer of Mamba, Mamba2 and linear attention's layers (transformers' `causal_conv1d_fn`).

Captured, it is a conv padded by k-1 on both sides and a slice of its first L outputs, whose
`L + k - 1` long middle value no split of the tokens can hold. Over a token split
`tess_compile.passes.causal_convs` makes the pair this one node, so that its rule
(`tess_compile.passes.rules.convolutions`) keeps the split: each rank convolves its block with the k-1
tokens before it. The per-rank graph calls torch's conv, never this target."""

from __future__ import annotations

import torch

__all__ = ["causal_conv1d"]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """The conv along x's last dim that sees each position and the k-1 before it (module docstring)."""
    halo = weight.shape[-1] - 1
    return torch.ops.aten.conv1d.default(x, weight, bias, [1], [halo], [1], groups)[..., :x.shape[-1]]
