"""Training with torch's own tools: gradient clipping over a sharded or simulated module.

The norm is that of the unsharded model's gradients: each element counted
once, however many ranks hold a replica of it. See docs/training.md.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale `module`'s gradients so that their global norm is at most `max_norm`; return the
    norm before clipping as a plain tensor (on every rank). `norm_type` may be `inf`.

    `module` is what `tess_compile.shard` or `tess_compile.simulate` returned.
    """
    clip = getattr(module, "clip_grad_norm_", None)
    if clip is None:
        raise ValueError(
            f"a {type(module).__name__} has no clip_grad_norm_ method: pass the module that tess_compile.shard "
            "or tess_compile.simulate returned, or use torch.nn.utils.clip_grad_norm_(module.parameters(), ...) "
            "for a plain module"
        )
    return clip(max_norm, norm_type)
