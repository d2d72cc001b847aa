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
gathered block outlives the attention that used it.

The kernel is torch's CPU flash attention (`_scaled_dot_product_flash_attention_for_cpu`,
which returns the log-sum-exp) on the CPU, and the same algebra written out
(`attend`, `attend_backward`) elsewhere. A query row that every key is masked
from gives zeros, as `scaled_dot_product_attention` does. Works on lists of
per-rank tensors, as `tess_compile.ops.fetched_product`.
"""

from __future__ import annotations

import math

import torch

from tess_compile.ops.collectives import Comm, active_comm, current_comm, use_comm

__all__ = ["attend", "attend_backward", "context_attention", "lockstep_context_attention", "position_bias"]

aten = torch.ops.aten


def position_bias(q_positions: torch.Tensor | None, key_positions: torch.Tensor, key_length: int,
                  is_causal: bool, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask of the rank's queries (at global `q_positions`) against keys at global
    `key_positions`: -inf where a key is padding (at `key_length` or after), in a query's future
    (`is_causal`: a key after the query, SDPA's top-left causal mask) or masked by `mask` (bool: False
    masks; float: added); None where nothing masks."""
    allowed = None
    if is_causal:
        allowed = key_positions[None, :] <= q_positions[:, None]
    if int(key_positions.numel()) > key_length:
        real = (key_positions < key_length)[None, :]
        allowed = real if allowed is None else allowed & real
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask if allowed is None else allowed & mask
        mask = None
    bias = None
    if allowed is not None:
        bias = torch.zeros(allowed.shape, dtype=dtype, device=key_positions.device).masked_fill(~allowed, -math.inf)
    if mask is not None:
        bias = mask.to(dtype) if bias is None else bias + mask.to(dtype)
    return bias


def _flash_on_cpu(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's CPU flash-attention kernel takes these queries (`[batch, heads, tokens, dim]`) and
    values (of the queries' head dim: multi-head latent attention's values are narrower)."""
    return (q.device.type == "cpu" and q.dim() == 4 and q.dtype in (torch.float64, torch.float32, torch.bfloat16)
            and v.shape[-1] == q.shape[-1])


def _four_dims(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A mask of two to four dims as the CPU kernel takes it: two, or four (leading dims of size 1)."""
    if bias is None or bias.dim() in (2, 4):
        return bias
    return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))


def attend(q, k, v, bias, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q @ k^T * scale + bias) @ v and the rows' log-sum-exp (q's dims but the last)."""
    if _flash_on_cpu(q, v):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=_four_dims(bias),
                                                                 scale=scale)
    scores = _scores(q, k, bias, scale)
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(_probabilities(scores, lse), v), lse


def attend_backward(grad, q, k, v, bias, out, lse, scale: float, bias_grad: bool = False) -> tuple:
    """The gradients of q, k and v of `attend` given the gradient of its output, and with `bias_grad`
    the gradient of the scores (the bias's, before summing it to the bias's shape; else None)."""
    if not bias_grad and _flash_on_cpu(q, v):
        return (*aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=_four_dims(bias), scale=scale), None)
    probabilities = _probabilities(_scores(q, k, bias, scale), lse)
    grad_v = torch.matmul(probabilities.transpose(-2, -1), grad)
    grad_p = torch.matmul(grad, v.transpose(-2, -1))
    grad_scores = probabilities * (grad_p - (grad * out).sum(-1, keepdim=True))
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * scale
    return grad_q, grad_k, grad_v, grad_scores if bias_grad else None


def _scores(q, k, bias, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    return scores if bias is None else scores + bias


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(scores - lse); zero in a row that every key is masked from (lse = -inf)."""
    return torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))


def _grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values repeated to `heads` heads (dim -3), as SDPA's enable_gqa pairs them."""
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _ungrouped(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_grouped`: each key/value head's query heads summed."""
    heads = grad.shape[-3]
    if heads == kv_heads:
        return grad
    return grad.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)


class _ContextAttention(torch.autograd.Function):
    """Per rank r: attention of `q[r]` over the fetched `k_used[r]`, `v_used[r]`; saves the own blocks.

    Flat inputs, each n tensors (None where absent): q, k_used, v_used, k_own, v_own, mask, q_positions.
    `fetch` lists the steps `(op, axis, *args)` that made the used blocks from the own ones.
    """

    @staticmethod
    def forward(ctx, comm, fetch, key_length, is_causal, scale, n, *tensors):
        qs, k_used, v_used, k_own, v_own, masks, positions = (tensors[i * n:(i + 1) * n] for i in range(7))
        ctx.comm, ctx.fetch, ctx.key_length, ctx.is_causal, ctx.scale, ctx.n = comm, fetch, key_length, is_causal, scale, n
        ctx.has_mask, ctx.has_positions = masks[0] is not None, positions[0] is not None
        outs, lses = [], []
        for r in range(n):
            heads = qs[r].shape[-3]
            bias = _bias(ctx, positions[r], k_used[r], masks[r], qs[r].dtype)
            out, lse = attend(qs[r], _grouped(k_used[r], heads), _grouped(v_used[r], heads), bias, scale)
            outs.append(out)
            lses.append(lse)
        ctx.save_for_backward(*qs, *k_own, *v_own, *outs, *lses, *(masks if ctx.has_mask else ()),
                              *(positions if ctx.has_positions else ()))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        saved = iter(ctx.saved_tensors)
        qs, k_own, v_own, outs, lses = ([next(saved) for _ in range(n)] for _ in range(5))
        masks, positions = ([next(saved) for _ in range(n)] if present else [None] * n
                            for present in (ctx.has_mask, ctx.has_positions))
        comm = ctx.comm or current_comm()
        k_used, v_used = _refetch(comm, k_own, ctx.fetch), _refetch(comm, v_own, ctx.fetch)
        mask_grad = any(ctx.needs_input_grad[6 + 5 * n:6 + 6 * n])  # a learned additive mask (a bias table)
        grad_q, grad_k, grad_v, grad_mask = [], [], [], []
        for r in range(n):
            heads, kv_heads = qs[r].shape[-3], k_used[r].shape[-3]
            bias = _bias(ctx, positions[r], k_used[r], masks[r], qs[r].dtype)
            dq, dk, dv, ds = attend_backward(grads[r], qs[r], _grouped(k_used[r], heads), _grouped(v_used[r], heads),
                                             bias, outs[r], lses[r], ctx.scale, bias_grad=mask_grad)
            grad_q.append(dq)
            grad_k.append(_ungrouped(dk, kv_heads))
            grad_v.append(_ungrouped(dv, kv_heads))
            grad_mask.append(None if ds is None else ds.sum_to_size(masks[r].shape).to(masks[r].dtype))
        return (None,) * 6 + (*grad_q, *grad_k, *grad_v) + (None,) * (2 * n) + (*grad_mask,) + (None,) * n


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
                       is_causal: bool, scale: float) -> list[torch.Tensor]:
    """`context_attention` over lists of per-rank tensors (the simulator's lockstep); `mask` and
    `q_positions` may be None."""
    n = len(q)
    mask, q_positions = ([None] * n if v is None else v for v in (mask, q_positions))
    return list(_ContextAttention.apply(comm, tuple(tuple(step) for step in fetch), key_length, is_causal, scale, n,
                                        *q, *k_used, *v_used, *k_own, *v_own, *mask, *q_positions))


def context_attention(q, k_used, v_used, k_own, v_own, mask, q_positions, fetch, key_length: int, is_causal: bool,
                      scale: float) -> torch.Tensor:
    """This rank's attention output over every key (a graph target; see the module docstring):
    `k_used`, `v_used` are the keys and values fetched from the own blocks `k_own`, `v_own` by the
    steps `fetch` (`(op, axis, *args)` each), in global token order; `q_positions` the global
    positions of the rank's queries (None: not causal and no key padding); `mask` the rank's rows of
    the attention mask (None: none); keys at `key_length` and after are padding."""
    wrap = (lambda t: None if t is None else [t])
    return lockstep_context_attention(active_comm(), [q], [k_used], [v_used], [k_own], [v_own], wrap(mask), wrap(q_positions),
                              fetch, key_length, is_causal, scale)[0]


context_attention._opname = "context_attention"
