"""Attention across a token split, one key block at a time (the ring schedule of context parallelism).

Each rank holds the queries, keys and values of its own tokens (`tess_compile.ops.context_attention`
holds the all-gather schedule). `ring_attention` visits the key and value blocks of the token axes one
after another: block `t` reaches every rank by broadcasts from its owner along the token axes (the
inner axis's, then the outer's), the rank's queries attend over it (`attention_kernels.attend`, masked
by the block's global positions), and the partial outputs merge by their log-sum-exp (an online
softmax), so a rank holds one block of keys and values at a time, not the whole sequence. Backward
visits the blocks again with the step's output and log-sum-exp, adds each block's query gradient and
reduces its key and value gradients to the block's owner (the broadcasts' adjoints). It saves this
rank's own blocks, its queries, the output and the log-sum-exp. Works on lists of per-rank tensors,
as `tess_compile.ops.fetched_product`.

The blocks are contiguous runs of tokens of `block` each, in the order the token axes split them
(block `a * rows + b` is the rank at depth `a`, row `b` of a split over depth and row).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from tess_compile.ops.attention_kernels import (
    attend_stripes,
    attend_stripes_backward,
    grouped,
    key_parts,
    mask_part,
    merge,
    position_bias,
    save_blocks,
    saved_blocks,
    stripe_rows,
    ungrouped,
)
from tess_compile.ops.collectives import Comm, ShapeComm, active_comm, current_comm, use_comm

__all__ = ["lockstep_ring_attention", "ring_attention"]


def _blocks(axes: tuple) -> list[tuple[int, tuple]]:
    """(block index, ((axis, source coordinate), ...) of its broadcasts, inner axis first) of every block
    of a split over `axes` ((name, size) pairs, outer first)."""
    sizes = [size for _, size in axes]
    out = []
    for coords in itertools.product(*(range(size) for size in sizes)):
        index = 0
        for coord, size in zip(coords, sizes):
            index = index * size + coord
        out.append((index, tuple((name, coord) for (name, _), coord in reversed(list(zip(axes, coords))))))
    return out


def _fetch(comm: Comm, own: list[torch.Tensor], sources: tuple, phase: str) -> list[torch.Tensor]:
    """Every rank's copy of the block that the ranks at `sources` hold, its last broadcast left running
    (`broadcast_start`: `_arrived` waits for it), so that it travels while the block before is used."""
    with use_comm(comm, phase=phase):
        for step, (axis, source) in enumerate(sources):
            op = "broadcast_start" if step == len(sources) - 1 else "broadcast"
            own = comm.run_all(op, [x.contiguous() for x in own], axis, source)
    return own


def _arrived(comm: Comm, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    return [comm.wait(x) for x in blocks]


def _visits(comm: Comm, ks: list[torch.Tensor], vs: list[torch.Tensor], axes: tuple, phase: str):
    """(block index, its sources, every rank's keys and values of it) for each block in turn, the next
    block's broadcasts started before this one is handed out."""
    blocks = _blocks(axes)
    pending = (_fetch(comm, ks, blocks[0][1], phase), _fetch(comm, vs, blocks[0][1], phase))
    for step, (index, sources) in enumerate(blocks):
        keys, values = _arrived(comm, pending[0]), _arrived(comm, pending[1])
        if step + 1 < len(blocks):
            following = blocks[step + 1][1]
            pending = (_fetch(comm, ks, following, phase), _fetch(comm, vs, following, phase))
        yield index, sources, keys, values


def _reduce_home(comm: Comm, grads: list[torch.Tensor], sources: tuple) -> list[torch.Tensor]:
    """The sum of every rank's `grads` at the ranks at `sources` (zeros elsewhere): the broadcasts' adjoint."""
    with use_comm(comm, phase="backward"):
        for axis, source in reversed(sources):
            grads = comm.run_all("reduce", [g.contiguous() for g in grads], axis, source)
    return grads


class _RingAttention(torch.autograd.Function):
    """Per rank r: attention of `q[r]` over every block of keys; see the module docstring. Flat inputs,
    each n tensors (None where absent): q, k_own, v_own, mask (the rank's rows, every key's columns),
    q_positions."""

    @staticmethod
    def forward(ctx, comm, axes, block, key_length, is_causal, scale, stripes, n, *tensors):
        qs, ks, vs, masks, positions = (list(tensors[i * n:(i + 1) * n]) for i in range(5))
        ctx.comm, ctx.axes, ctx.block, ctx.key_length, ctx.is_causal, ctx.scale, ctx.stripes, ctx.n = (
            comm, axes, block, key_length, is_causal, scale, stripes, n)
        outs = [torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device) for q, v in zip(qs, vs)]
        lses = [torch.full(q.shape[:-1], -math.inf, dtype=_lse_dtype(q), device=q.device) for q in qs]
        ctx.runs = _causal_runs(ctx, qs[0])
        for index, _, k_block, v_block in _visits(comm, ks, vs, axes, "forward"):
            for r in range(n):
                heads = qs[r].shape[-3]
                bias = _block_bias(ctx, positions[r], masks[r], index, qs[r])
                k, v = grouped(k_block[r], heads), grouped(v_block[r], heads)
                out, lse = attend_stripes(qs[r], k, v, _runs(ctx, qs[r], masks[r]), functools.partial(_sliced, bias),
                                          scale)
                outs[r], lses[r] = merge(outs[r], lses[r], out, lse.to(lses[r].dtype))
        save_blocks(ctx, qs, ks, vs, outs, lses, masks, positions)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        qs, ks, vs, outs, lses, masks, positions = saved_blocks(ctx, n)
        comm = ctx.comm or current_comm()
        mask_grad = any(ctx.needs_input_grad[8 + 3 * n:8 + 4 * n])  # a learned additive mask (a bias table)
        grad_q = [torch.zeros_like(q) for q in qs]
        grad_k, grad_v = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
        grad_mask = [torch.zeros_like(m) if mask_grad else None for m in masks]
        for index, sources, k_block, v_block in _visits(comm, ks, vs, ctx.axes, "backward"):
            dks, dvs = [], []
            for r in range(n):
                heads, kv_heads = qs[r].shape[-3], ks[r].shape[-3]
                bias = _block_bias(ctx, positions[r], masks[r], index, qs[r])
                k, v = grouped(k_block[r], heads), grouped(v_block[r], heads)
                dq, dk, dv, scores = attend_stripes_backward(
                    grads[r], qs[r], k, v, _runs(ctx, qs[r], masks[r]), functools.partial(_sliced, bias), outs[r],
                    lses[r].to(qs[r].dtype), ctx.scale, bias_grad=mask_grad)
                grad_q[r] += dq
                dks.append(ungrouped(dk, kv_heads))
                dvs.append(ungrouped(dv, kv_heads))
                if mask_grad:
                    _add_columns(ctx, grad_mask[r], scores, index, _key_positions(ctx, index, qs[r].device))
            grad_k = [g + d for g, d in zip(grad_k, _reduce_home(comm, dks, sources))]
            grad_v = [g + d for g, d in zip(grad_v, _reduce_home(comm, dvs, sources))]
        return (None,) * 8 + (*grad_q, *grad_k, *grad_v, *grad_mask) + (None,) * n


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's dtype: float32 at least, as the kernels keep it."""
    return torch.promote_types(q.dtype, torch.float32)


def _causal_runs(ctx, q: torch.Tensor) -> int:
    """The stripes each query stripe meets a block in (`attention_kernels.stripe_rows`): the order's
    stripes under a causal self-attention (as many queries as keys), else 1 (every query every key)."""
    blocks = math.prod(size for _, size in ctx.axes)
    return ctx.stripes if ctx.is_causal and q.shape[-2] * blocks == ctx.key_length else 1


def _runs(ctx, q: torch.Tensor, mask) -> list[tuple[slice, list]]:
    """(the rows, the runs of a block's keys they see: `attention_kernels.key_parts`) of each stripe of
    the queries; the block's stripes before a query stripe's own seen whole where the causal mask is the
    only one (no mask, no key padding)."""
    causal_only = ctx.runs > 1 and mask is None and ctx.block * math.prod(s for _, s in ctx.axes) == ctx.key_length
    return [(rows, key_parts(ctx.block, ctx.runs, j, causal_only))
            for j, rows in enumerate(stripe_rows(q.shape[-2], ctx.runs))]


def _sliced(bias: torch.Tensor | None, rows: slice):
    """A block's additive mask of the queries `rows` against the block's keys `start` to `stop`, as a
    function of the run."""
    return lambda start, stop: mask_part(bias, rows, start, stop)


def _key_positions(ctx, index: int, device) -> torch.Tensor:
    """The global positions of the keys of block `index`: a contiguous run of `block`, or in a striped
    token order (`ctx.stripes` > 1) the block's run of each part of the sequence."""
    if ctx.stripes == 1:
        return torch.arange(index * ctx.block, (index + 1) * ctx.block, device=device)
    run = ctx.block // ctx.stripes
    part = run * math.prod(size for _, size in ctx.axes)
    starts = torch.arange(ctx.stripes, device=device) * part + index * run
    return (starts[:, None] + torch.arange(run, device=device)[None, :]).flatten()


def _block_bias(ctx, q_positions, mask, index: int, q: torch.Tensor) -> torch.Tensor | None:
    """The additive mask of one rank's queries against the keys of block `index`."""
    keys = _key_positions(ctx, index, q.device)
    columns = None if mask is None else _columns(ctx, mask, index, keys)
    return position_bias(q_positions, keys, ctx.key_length, ctx.is_causal, columns, q.dtype)


def _columns(ctx, mask: torch.Tensor, index: int, keys: torch.Tensor) -> torch.Tensor:
    """The columns of a mask over `key_length` keys that block `index` holds (at positions `keys`): a
    striped order's (which splits evenly) picked; a contiguous block's cut, past the mask's end (key
    padding) masked: False of a bool mask, -inf of a float one."""
    if ctx.stripes > 1:
        return mask.index_select(-1, keys)
    start, count = index * ctx.block, ctx.block
    present = max(0, min(count, ctx.key_length - start))
    taken = mask.narrow(-1, start, present)
    if present == count:
        return taken
    shape = list(mask.shape[:-1]) + [count - present]
    fill = torch.zeros(shape, dtype=torch.bool, device=mask.device) if mask.dtype == torch.bool else \
        torch.full(shape, -math.inf, dtype=mask.dtype, device=mask.device)
    return torch.cat([taken, fill], dim=-1)


def _add_columns(ctx, total: torch.Tensor, scores_grad: torch.Tensor, index: int, keys: torch.Tensor) -> None:
    """Add block `index`'s score gradient to its columns (at positions `keys`) of a learned mask's gradient
    (summed to its shape); the columns of key padding dropped."""
    if ctx.stripes > 1:
        total.index_add_(-1, keys, scores_grad.sum_to_size(*total.shape[:-1], keys.numel()).to(total.dtype))
        return
    start = index * ctx.block
    present = max(0, min(scores_grad.shape[-1], total.shape[-1] - start))
    columns = total.narrow(-1, start, present)
    columns += scores_grad.narrow(-1, 0, present).sum_to_size(columns.shape).to(total.dtype)


def lockstep_ring_attention(comm: Comm, q, k_own, v_own, mask, q_positions, axes, block: int, key_length: int,
                            is_causal: bool, scale: float, stripes: int = 1) -> list[torch.Tensor]:
    """`ring_attention` over lists of per-rank tensors (the simulator's lockstep); `mask` and
    `q_positions` may be None."""
    n = len(q)
    mask, q_positions = ([None] * n if v is None else v for v in (mask, q_positions))
    return list(_RingAttention.apply(comm, tuple(tuple(axis) for axis in axes), block, key_length, is_causal, scale,
                                     stripes, n, *q, *k_own, *v_own, *mask, *q_positions))


def ring_attention(q, k_own, v_own, mask, q_positions, axes, block: int, key_length: int, is_causal: bool,
                   scale: float, stripes: int = 1) -> torch.Tensor:
    """This rank's attention output over every key, one block of `block` keys at a time (a graph target;
    see the module docstring): `axes` are the token axes as `(name, size)`, outer first; `q_positions`
    the global positions of the rank's queries (None: not causal and no key padding); `mask` the rank's
    rows of the attention mask over all `key_length` keys (None: none); `stripes` > 1: queries and keys
    in a striped token order (a block holds a run of each part of the sequence), under a causal mask
    each stripe of queries against the stripes of a block it may see alone."""
    wrap = (lambda t: None if t is None else [t])
    comm = active_comm() or ShapeComm()  # a fake run (no module running) fetches blocks of the right shape
    return lockstep_ring_attention(comm, [q], [k_own], [v_own], wrap(mask), wrap(q_positions), axes, block,
                                   key_length, is_causal, scale, stripes)[0]


ring_attention._opname = "ring_attention"
