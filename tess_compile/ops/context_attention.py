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

import torch

from tess_compile.ops.attention_kernels import (
    attend,
    grouped,
    position_bias,
    save_blocks,
    saved_blocks,
    scores_of,
    stripe_runs,
    striped_backward,
    ungrouped,
)
from tess_compile.ops.collectives import Comm, active_comm, current_comm, use_comm

__all__ = ["context_attention", "lockstep_context_attention"]


class _ContextAttention(torch.autograd.Function):
    """Per rank r: attention of `q[r]` over the fetched `k_used[r]`, `v_used[r]`; saves the own blocks.

    Flat inputs, each n tensors (None where absent): q, k_used, v_used, k_own, v_own, mask, q_positions.
    `fetch` lists the steps `(op, axis, *args)` that made the used blocks from the own ones; `stripes`
    the stripes of the queries (`attention_kernels.stripe_runs`).
    """

    @staticmethod
    def forward(ctx, comm, fetch, key_length, is_causal, scale, stripes, n, *tensors):
        qs, k_used, v_used, k_own, v_own, masks, positions = (tensors[i * n:(i + 1) * n] for i in range(7))
        ctx.comm, ctx.fetch, ctx.key_length, ctx.is_causal, ctx.scale, ctx.n = comm, fetch, key_length, is_causal, scale, n
        ctx.stripes = stripes
        outs, lses = [], []
        for r in range(n):
            heads = qs[r].shape[-3]
            bias = _bias(ctx, positions[r], k_used[r], masks[r], qs[r].dtype)
            k, v = grouped(k_used[r], heads), grouped(v_used[r], heads)
            parts = [attend(qs[r][..., rows, :], k[..., :keys, :], v[..., :keys, :], scores_of(bias, rows, keys), scale)
                     for rows, keys in stripe_runs(qs[r].shape[-2], k.shape[-2], stripes)]
            outs.append(torch.cat([out for out, _ in parts], dim=-2))
            lses.append(torch.cat([lse for _, lse in parts], dim=-1))
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
            bias = _bias(ctx, positions[r], k_used[r], masks[r], qs[r].dtype)
            dq, dk, dv, ds = striped_backward(grads[r], qs[r], grouped(k_used[r], heads), grouped(v_used[r], heads),
                                              bias, outs[r], lses[r], ctx.scale, ctx.stripes, mask_grad)
            grad_q.append(dq)
            grad_k.append(ungrouped(dk, kv_heads))
            grad_v.append(ungrouped(dv, kv_heads))
            grad_mask.append(None if ds is None else ds.sum_to_size(masks[r].shape).to(masks[r].dtype))
        return (None,) * 7 + (*grad_q, *grad_k, *grad_v) + (None,) * (2 * n) + (*grad_mask,) + (None,) * n


def _bias(ctx, q_positions, k_used, mask, dtype) -> torch.Tensor | None:
    """The additive mask of one rank's queries against the fetched keys (in global order)."""
    keys = torch.arange(k_used.shape[-2], device=k_used.device)
    return position_bias(q_positions, keys, ctx.key_length, ctx.is_causal, mask, dtype)


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
    it may see alone (`attention_kernels.stripe_runs`)."""
    wrap = (lambda t: None if t is None else [t])
    return lockstep_context_attention(active_comm(), [q], [k_used], [v_used], [k_own], [v_own], wrap(mask),
                                      wrap(q_positions), fetch, key_length, is_causal, scale, stripes)[0]


context_attention._opname = "context_attention"
