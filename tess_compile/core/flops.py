"""The FLOP counter that every count of the project uses: torch's `FlopCounterMode` with the formulas it lacks.

torch counts matrix products, convolutions and its GPU attention kernels. It
has no formula for two kinds of kernel that models here run:

- CPU attention: on the CPU, `scaled_dot_product_attention` runs
  `_scaled_dot_product_flash_attention_for_cpu`, so attention would vanish from
  redundant-work ratios and FLOP totals. Counted (with its backward) as torch
  counts the GPU kernels: the full query-by-key product, masks ignored.
- FFTs (`aten._fft_r2c`, `_fft_c2r`, `_fft_c2c`, which `torch.fft.*` dispatch
  to), used by models that mix tokens by FFTs (FNet, Hyena's long
  convolutions). Counted the usual way (Cooley-Tukey, as FFTW's benchmarks
  count): a complex transform of n points takes 5 n log2(n) FLOPs, a real one
  half that, and a transform over several dims 5 N sum(log2 n_d) for N points
  in all.

The passes (repeated work) and the analyses (accounting) both count with it.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["ATTENTION_FLOPS", "FFT_FLOPS", "flop_counter"]

aten = torch.ops.aten


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _fft_flops(shape, dims, factor: float) -> int:
    """`factor` N sum(log2 n_d) for a transform over `dims` of a tensor of `shape` (N its numel)."""
    return int(factor * math.prod(shape) * sum(math.log2(shape[d]) for d in dims if shape[d] > 1))


def _c2c(x_shape, dim, normalization, forward, out_shape=None, **kwargs) -> int:
    return _fft_flops(x_shape, dim, 5)


def _r2c(x_shape, dim, normalization, onesided, out_shape=None, **kwargs) -> int:
    return _fft_flops(x_shape, dim, 2.5)


def _c2r(x_shape, dim, normalization, last_dim_size, out_shape=None, **kwargs) -> int:
    return _fft_flops(out_shape, dim, 2.5)


# keyed by the op packet, as FlopCounterMode looks formulas up
ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
FFT_FLOPS = {aten._fft_c2c: _c2c, aten._fft_r2c: _r2c, aten._fft_c2r: _c2r}


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode (not displayed) that counts CPU attention (`ATTENTION_FLOPS`) and FFTs
    (`FFT_FLOPS`) too."""
    return FlopCounterMode(display=False, custom_mapping={**ATTENTION_FLOPS, **FFT_FLOPS})
