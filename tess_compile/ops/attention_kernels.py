"""The local algebra of attention split by keys: one rank's queries against a block of keys, with the
log-sum-exp that merges such blocks, and its backward, for `tess_compile.ops.context_attention` and
`tess_compile.ops.ring_attention`.

The kernel is torch's CPU flash attention (`_scaled_dot_product_flash_attention_for_cpu`,
which returns the log-sum-exp) on the CPU where it applies, and the same algebra written out
elsewhere. A query row that every key of a block is masked from gives zeros and a log-sum-exp of
-inf (so that blocks merge exactly), as `scaled_dot_product_attention` gives zeros. In a striped token
order under a causal mask (`tess_compile.core.row_split.RowSplit.stripes`) each stripe of queries runs
against the stripes of keys it may see alone (`stripe_rows`, `key_parts`), the same shapes on every rank.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attend", "attend_backward", "attend_parts", "attend_parts_backward", "attend_stripes",
           "attend_stripes_backward", "grouped", "key_parts", "mask_part", "merge", "position_bias", "save_blocks",
           "saved_blocks", "stripe_rows", "ungrouped"]

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
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=_four_dims(bias),
                                                                    scale=scale)
        if bias is not None:  # the kernel gives a row masked from every key 0, not -inf
            lse = lse.masked_fill(torch.isneginf(bias).all(-1).expand(lse.shape), -math.inf)
        return out, lse
    scores = _scores(q, k, bias, scale)
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(_probabilities(scores, lse), v), lse


def attend_backward(grad, q, k, v, bias, out, lse, scale: float, bias_grad: bool = False) -> tuple:
    """The gradients of q, k and v of `attend` given the gradient of its output, and with `bias_grad`
    the gradient of the scores (the bias's, before summing it to the bias's shape; else None)."""
    if not bias_grad and _flash_on_cpu(q, v):
        lse = torch.where(torch.isinf(lse), 0.0, lse)  # the kernel's own value for a fully masked row
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


def grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values repeated to `heads` heads (dim -3), as SDPA's enable_gqa pairs them."""
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def ungrouped(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_grouped`: each key/value head's query heads summed."""
    heads = grad.shape[-3]
    if heads == kv_heads:
        return grad
    return grad.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """The attention over the keys of two sets of blocks from each one's output and log-sum-exp
    (an online softmax step); rows masked from every key so far stay zero with -inf."""
    total = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(total), 0.0, total)
    out = out * torch.exp(lse - finite).unsqueeze(-1).to(out.dtype) \
        + block_out * torch.exp(block_lse - finite).unsqueeze(-1).to(out.dtype)
    return out, total


def stripe_rows(queries: int, stripes: int) -> list[slice]:
    """The rows of a rank's queries in each stripe of a striped token order
    (`tess_compile.core.row_split.RowSplit`): stripe j's queries lie in part j of the sequence and,
    under a causal mask, see the keys of parts 0 to j (`key_parts`); one run of every query otherwise."""
    rows = queries // stripes
    return [slice(j * rows, (j + 1) * rows) for j in range(stripes)]


def key_parts(keys: int, stripes: int, stripe: int, causal_only: bool) -> list[tuple[int, int, bool]]:
    """The runs `(start, stop, masked)` of the keys the queries of `stripe` (of `stripes`, `stripe_rows`)
    may see: where the causal mask is the only one (`causal_only`), the parts before the stripe's own
    are seen whole by every query (no mask to make) and only its own part is masked; else one masked run."""
    part = keys // stripes
    if causal_only and stripe > 0:
        return [(0, stripe * part, False), (stripe * part, (stripe + 1) * part, True)]
    return [(0, (stripe + 1) * part, True)]


def attend_parts(q, k, v, parts, bias_of, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` of `q` over the key runs `parts` (`key_parts`), merged by their log-sum-exp; `bias_of(start,
    stop)` makes a masked run's additive mask."""
    out, lse = None, None
    for start, stop, masked in parts:
        bias = bias_of(start, stop) if masked else None
        part_out, part_lse = attend(q, k[..., start:stop, :], v[..., start:stop, :], bias, scale)
        out, lse = (part_out, part_lse) if out is None else merge(out, lse, part_out, part_lse)
    return out, lse


def attend_parts_backward(grad, q, k, v, parts, bias_of, out, lse, scale: float, bias_grad: bool = False):
    """The gradients of `attend_parts`: each run's from the whole attention's output and log-sum-exp,
    the queries' summed, the keys' and values' at their run (zeros past the last); with `bias_grad` a
    list of each masked run's score gradient `(start, stop, gradient)`."""
    grad_q, grad_k, grad_v, scores = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), []
    for start, stop, masked in parts:
        dq, dk, dv, ds = attend_backward(grad, q, k[..., start:stop, :], v[..., start:stop, :],
                                         bias_of(start, stop) if masked else None, out, lse, scale,
                                         bias_grad=bias_grad and masked)
        grad_q += dq
        grad_k[..., start:stop, :] += dk
        grad_v[..., start:stop, :] += dv
        if ds is not None:
            scores.append((start, stop, ds))
    return grad_q, grad_k, grad_v, scores


def attend_stripes(q, k, v, runs, bias_of, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_parts` of each stripe of the queries: `runs` is `(rows, key parts)` of each stripe, the rows
    covering q's in order (`stripe_rows`), and `bias_of(rows)` the stripe's `bias_of(start, stop)`; the
    output and log-sum-exp of all of q's rows."""
    parts = [attend_parts(q[..., rows, :], k, v, keys, bias_of(rows), scale) for rows, keys in runs]
    return torch.cat([out for out, _ in parts], dim=-2), torch.cat([lse for _, lse in parts], dim=-1)


def attend_stripes_backward(grad, q, k, v, runs, bias_of, out, lse, scale: float, bias_grad: bool = False):
    """The gradients of `attend_stripes`: of q, k and v, and with `bias_grad` the scores' over all of q's
    rows and k's keys (None without)."""
    grad_q, grad_k, grad_v = [], torch.zeros_like(k), torch.zeros_like(v)
    scores = q.new_zeros(*q.shape[:-1], k.shape[-2]) if bias_grad else None
    for rows, keys in runs:
        dq, dk, dv, parts = attend_parts_backward(grad[..., rows, :], q[..., rows, :], k, v, keys, bias_of(rows),
                                                  out[..., rows, :], lse[..., rows], scale, bias_grad=bias_grad)
        grad_q.append(dq)
        grad_k += dk
        grad_v += dv
        for start, stop, ds in parts:
            scores[..., rows, start:stop] += ds
    return torch.cat(grad_q, dim=-2), grad_k, grad_v, scores


def mask_part(mask: torch.Tensor | None, rows: slice, start: int, stop: int) -> torch.Tensor | None:
    """A mask's entries of the queries `rows` and the keys `start` to `stop` (a dim it broadcasts along
    kept)."""
    if mask is None:
        return None
    mask = mask if mask.shape[-2] == 1 else mask[..., rows, :]
    return mask if mask.shape[-1] == 1 else mask[..., start:stop]


def save_blocks(ctx, qs, ks, vs, outs, lses, masks, positions) -> None:
    """Save for backward the n ranks' blocks an attention schedule keeps: queries, keys, values, outputs
    and log-sum-exps, and masks and query positions where given (`saved_blocks` reads them back)."""
    ctx.has_mask, ctx.has_positions = masks[0] is not None, positions[0] is not None
    ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses, *(masks if ctx.has_mask else ()),
                          *(positions if ctx.has_positions else ()))


def saved_blocks(ctx, n: int) -> tuple[list, ...]:
    """`save_blocks`' lists back: queries, keys, values, outputs, log-sum-exps, masks and positions (a
    list of None where none was given)."""
    saved = iter(ctx.saved_tensors)
    qs, ks, vs, outs, lses = ([next(saved) for _ in range(n)] for _ in range(5))
    masks, positions = ([next(saved) for _ in range(n)] if present else [None] * n
                        for present in (ctx.has_mask, ctx.has_positions))
    return qs, ks, vs, outs, lses, masks, positions
