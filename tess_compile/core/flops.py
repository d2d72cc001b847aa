"""FLOP counting: torch's `FlopCounterMode` with the formulas it lacks.

torch counts the matmul-like ops and its GPU attention kernels; on the CPU,
`scaled_dot_product_attention` runs `_scaled_dot_product_flash_attention_for_cpu`,
which it does not count, so attention would vanish from redundant-work ratios
and FLOP totals. `flop_counter` adds that kernel and its backward, counted as
torch counts the GPU kernels (the full query-by-key product, masks ignored).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["flop_counter"]

aten = torch.ops.aten


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """A `FlopCounterMode` (no display) that also counts the kernels of `_FORMULAS`."""
    return FlopCounterMode(display=False, custom_mapping=_FORMULAS)
