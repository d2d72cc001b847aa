"""Attention across a token split (context parallelism), with a memory-lean backward.

Each rank holds the queries, keys and values of its own tokens: a block of the
sequence on each rank of the token axes (`tess_compile.core.row_split`). The
per-rank graph fetches the other ranks' keys and values (all-gathers along the
token axes, Llama 3's context parallelism) and `context_attention` runs the
rank's queries against all of them, masked by the global positions of its
queries and keys: a causal mask, and the rank's rows of a given mask. It keeps
for backward only this rank's own key and value blocks, its queries, the output
and the log-sum-exp, as a flash-attention kernel does; backward fetches the keys
and values again (as `tess_compile.ops.fetched_product` fetches its blocks) and
hands their gradients to the all-gathers' adjoints, reduce-scatters. So no
gathered block outlives the attention that used it. The kernels are
`tess_compile.ops.attention_kernels`'. Works on lists of per-rank tensors, as
`tess_compile.ops.fetched_product`.
"""

from __future__ import annotations

import functools

import torch

from tess_compile.ops.attention_kernels import (
    attend_stripes,
    attend_stripes_backward,
    grouped,
    key_parts,
    mask_part,
    position_bias,
    save_blocks,
    saved_blocks,
    stripe_rows,
    ungrouped,
)
from tess_compile.ops.collectives import Comm, active_comm, current_comm, use_comm

__all__ = ["context_attention", "lockstep_context_attention"]


class _ContextAttention(torch.autograd.Function):
    """Per rank r: attention of `q[r]` over the fetched `k_used[r]`, `v_used[r]`; saves the own blocks.

    Flat inputs, each n tensors (None where absent): q, k_used, v_used, k_own, v_own, mask, q_positions.
    `fetch` lists the steps `(op, axis, *args)` that made the used blocks from the own ones; `stripes`
    the stripes of the queries (`attention_kernels.stripe_rows`).
    """

    @staticmethod
    def forward(ctx, comm, fetch, key_length, is_causal, scale, stripes, n, *tensors):
        qs, k_used, v_used, k_own, v_own, masks, positions = (tensors[i * n:(i + 1) * n] for i in range(7))
        ctx.comm, ctx.fetch, ctx.key_length, ctx.is_causal, ctx.scale, ctx.n = comm, fetch, key_length, is_causal, scale, n
        ctx.stripes = stripes
        outs, lses = [], []
        for r in range(n):
            heads = qs[r].shape[-3]
            k, v = grouped(k_used[r], heads), grouped(v_used[r], heads)
            out, lse = attend_stripes(qs[r], k, v, _runs(ctx, qs[r], k, masks[r]),
                                      functools.partial(_bias_of, ctx, positions[r], masks[r], q=qs[r]), scale)
            outs.append(out)
            lses.append(lse)
        save_blocks(ctx, qs, k_own, v_own, outs, lses, masks, positions)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        qs, k_own, v_own, outs, lses, masks, positions = saved_blocks(ctx, n)
        comm = ctx.comm or current_comm()
        k_used, v_used = _refetch(comm, k_own, ctx.fetch), _refetch(comm, v_own, ctx.fetch)
        mask_grad = any(ctx.needs_input_grad[7 + 5 * n:7 + 6 * n])  # a learned additive mask (a bias table)
        grad_q, grad_k, grad_v, grad_mask = [], [], [], []
        for r in range(n):
            heads, kv_heads = qs[r].shape[-3], k_used[r].shape[-3]
            k, v = grouped(k_used[r], heads), grouped(v_used[r], heads)
            dq, dk, dv, scores = attend_stripes_backward(
                grads[r], qs[r], k, v, _runs(ctx, qs[r], k, masks[r]),
                functools.partial(_bias_of, ctx, positions[r], masks[r], q=qs[r]), outs[r], lses[r], ctx.scale,
                bias_grad=mask_grad)
            grad_q.append(dq)
            grad_k.append(ungrouped(dk, kv_heads))
            grad_v.append(ungrouped(dv, kv_heads))
            grad_mask.append(None if scores is None else scores.sum_to_size(masks[r].shape).to(masks[r].dtype))
        return (None,) * 7 + (*grad_q, *grad_k, *grad_v) + (None,) * (2 * n) + (*grad_mask,) + (None,) * n


def _runs(ctx, q: torch.Tensor, k: torch.Tensor, mask) -> list[tuple[slice, list]]:
    """(the rows, the key runs they see: `attention_kernels.key_parts`) of each stripe of the queries; runs
    seen whole where the causal mask is the only one (no mask, no key padding)."""
    causal_only = ctx.is_causal and mask is None and k.shape[-2] == ctx.key_length
    return [(rows, key_parts(k.shape[-2], ctx.stripes, j, causal_only))
            for j, rows in enumerate(stripe_rows(q.shape[-2], ctx.stripes))]


def _bias_of(ctx, q_positions, mask, rows: slice, q: torch.Tensor):
    """The additive mask of the queries `rows` against the fetched keys `start` to `stop` (global order),
    as a function of the run."""
    positions = None if q_positions is None else q_positions[rows]

    def bias(start: int, stop: int) -> torch.Tensor | None:
        keys = torch.arange(start, stop, device=q.device)
        return position_bias(positions, keys, ctx.key_length, ctx.is_causal, mask_part(mask, rows, start, stop),
                             q.dtype)

    return bias


def _refetch(comm: Comm, own: list[torch.Tensor], fetch: tuple) -> list[torch.Tensor]:
    with use_comm(comm, phase="backward"):
        for op, axis, *args in fetch:
            own = comm.run_all(op, [x.contiguous() for x in own], axis, *args)
    return own


def lockstep_context_attention(comm: Comm, q, k_used, v_used, k_own, v_own, mask, q_positions, fetch, key_length: int,
                               is_causal: bool, scale: float, stripes: int = 1) -> list[torch.Tensor]:
    """`context_attention` over lists of per-rank tensors (the simulator's lockstep); `mask` and
    `q_positions` may be None."""
    n = len(q)
    mask, q_positions = ([None] * n if v is None else v for v in (mask, q_positions))
    return list(_ContextAttention.apply(comm, tuple(tuple(step) for step in fetch), key_length, is_causal, scale,
                                        stripes, n, *q, *k_used, *v_used, *k_own, *v_own, *mask, *q_positions))


def context_attention(q, k_used, v_used, k_own, v_own, mask, q_positions, fetch, key_length: int, is_causal: bool,
                      scale: float, stripes: int = 1) -> torch.Tensor:
    """This rank's attention output over every key (a graph target; see the module docstring):
    `k_used`, `v_used` are the keys and values fetched from the own blocks `k_own`, `v_own` by the
    steps `fetch` (`(op, axis, *args)` each), in global token order; `q_positions` the global
    positions of the rank's queries (None: not causal and no key padding); `mask` the rank's rows of
    the attention mask (None: none); keys at `key_length` and after are padding. `stripes` > 1: the
    queries are the stripes of a striped token order under a causal mask, each run against the keys
    it may see alone (`attention_kernels.stripe_rows`)."""
    wrap = (lambda t: None if t is None else [t])
    return lockstep_context_attention(active_comm(), [q], [k_used], [v_used], [k_own], [v_own], wrap(mask),
                                      wrap(q_positions), fetch, key_length, is_causal, scale, stripes)[0]


context_attention._opname = "context_attention"
