"""Rules of FFTs (`torch.fft`: fft, ifft, rfft, irfft, hfft, ihfft and their 2-D and N-D forms).

An FFT mixes every element along the dims it transforms, so those dims are whole
on every rank (gathered where a split reaches them) and every other split is
kept: FNet's token mixing along the sequence, or a long convolution by
`irfft(rfft(x) * rfft(k))` (Hyena), runs on each rank's own batch rows and
features, with no communication. The sizes (`n`, `s`) are those of whole dims,
so the op runs as it is on the local tensors. The FLOP counter counts the
kernels these ops dispatch to (`tess_compile.core.flops`).
"""

from __future__ import annotations

from torch.fx import Node

from tess_compile.passes.rules.common import R, aten, dims_local, get_arg, is_param, shape_of
from tess_compile.passes.rules.family import Decision, Family
from tess_compile.core.layout import Layout, Shard

__all__ = ["FAMILY", "PLACEMENT", "place_fft", "transformed_dims"]

_ONE_DIM = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
_SHIFTS = (aten.fft_fftshift.default, aten.fft_ifftshift.default)


def transformed_dims(node: Node) -> list[int]:
    """The dims an FFT op of `torch.fft` works across: `dim` (x, n, dim, norm) of a 1-D transform,
    `dim` of a 2-D one (default the last two), of an N-D one the given dims, else the last `len(s)`
    dims, else all; of fftshift, `dim` (x, dim), else all."""
    ndim = len(shape_of(node.args[0]))
    if node.target in _SHIFTS:
        dims = get_arg(node, 1, "dim")
    else:
        name = node.target._opname.removeprefix("fft_")
        if name in _ONE_DIM:
            return [get_arg(node, 2, "dim", -1)]
        dims = get_arg(node, 2, "dim", (-2, -1) if name.endswith("2") else None)
        sizes = get_arg(node, 1, "s")
        if dims is None and sizes is not None:
            dims = range(ndim - len(sizes), ndim)
    if dims is None:
        return list(range(ndim))
    return [dims] if isinstance(dims, int) else list(dims)


def place_fft(node: Node, ctx) -> Decision:
    """The transformed dims whole, other splits kept (`dims_local`); a free parameter (a long
    convolution's filter `[s, h]`) has its last other dim split over col, as the features of the
    activations it meets are."""
    x = node.args[0]
    dims = [d % len(shape_of(x)) for d in transformed_dims(node)]
    others = [d for d in range(len(shape_of(x))) if d not in dims]
    if ctx.layout(x) is None and is_param(x) and others and shape_of(x)[others[-1]] % ctx.mesh.size("col") == 0:
        layout = Layout(R, R, Shard(others[-1]))
        return Decision({x: layout}, layout)
    return dims_local(transformed_dims)(node, ctx)


_FFTS = [getattr(aten, f"fft_{kind}{form}").default for kind in _ONE_DIM for form in ("", "2", "n")]

PLACEMENT = {**{op: place_fft for op in _FFTS}, **{op: dims_local(transformed_dims) for op in _SHIFTS}}

FAMILY = Family("fourier", PLACEMENT)
