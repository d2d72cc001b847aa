"""The FLOP counter that every count of the project uses: torch's FlopCounterMode, FFTs added.

torch's `FlopCounterMode` counts matrix products, convolutions and attention;
it has no formula for the FFT kernels (`aten._fft_r2c`, `_fft_c2r`, `_fft_c2c`,
which `torch.fft.*` dispatch to), so a model that mixes tokens by FFTs (FNet,
Hyena's long convolutions) would show neither their work nor its repeats.
`flop_counter()` counts them the usual way (Cooley-Tukey, as FFTW's benchmarks
count): a complex transform of n points takes 5 n log2(n) FLOPs, a real one half
that, and a transform over several dims 5 N sum(log2 n_d) for N points in all.
The passes (repeated work) and the analyses (accounting) both count with it.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FFT_FLOPS", "flop_counter"]

aten = torch.ops.aten


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
FFT_FLOPS = {aten._fft_c2c: _c2c, aten._fft_r2c: _r2c, aten._fft_c2r: _c2r}


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode (not displayed) that counts FFTs too (`FFT_FLOPS`)."""
    return FlopCounterMode(display=False, custom_mapping=FFT_FLOPS)
