"""Random draws of the per-rank graph that equal the unsharded model's: dropout, the
dropout of scaled_dot_product_attention, and random ops that run whole on every rank.

A dropout mask must be the one the unsharded model draws, or a sharded model
in train mode computes another function than the unsharded one (and replicas
of one value drop different elements). On CPU torch's generator is not
offset-based: a draw's values depend on everything drawn before it and on the
order in which the kernel fills the tensor. So each rank makes the full draw
of the unsharded op, with the same call on a tensor of the same global shape,
strides, dtype and device, in the same order as the unsharded graph, and
keeps the block its layout gives it (`tess_compile.core.layout.local_block`).
Every rank, given the same seed, draws the same full mask, and the generator
advances as in the unsharded model.

The draws, as torch's CPU kernels make them (`aten/src/ATen/native/Dropout.cpp`):

- `aten.dropout(x, p, True)`: `noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)`,
  then `x * noise` (kind "noise"; `dropout_` multiplies in place);
- `aten.native_dropout(x, p, True)`: `mask = empty_like(x, dtype=bool).bernoulli_(1 - p)`,
  then `x * (mask * scale)` in x's dtype, `scale = 1 / (1 - p)`, and backward
  `native_dropout_backward(grad, mask, scale)` (kind "mask");
- `aten.scaled_dot_product_attention(..., dropout_p)`: on CPU only the math path
  takes dropout; it runs `aten.dropout` on the attention weights `[..., L, S]`.
  `sharded_attention` runs torch's own op on the local blocks and replaces its
  one `bernoulli_` by this rank's block of the full draw (kind "bits"), so
  every other operation is torch's.

On other devices dropout draws inside a fused kernel: kind "noise" and "mask"
then call that same op on a tensor of ones of the global shape (untested on
GPUs here), and attention whose mask is drawn inside a fused kernel raises.

Each graph target has a per-rank version, which the distributed runtime runs
(`dropout_draw`, a custom op, reads this rank's coordinates from the
communicator at run time, so one compiled graph serves every rank), and a
lockstep version over the list of every rank's tensors, which the simulator
runs (`LOCKSTEP`): all ranks share one process and one generator there, so it
draws the full mask once per node and gives each rank its block.

`replicated_draw` is a random op (rand, randn, bernoulli, ...) whose output is
whole on every rank. Every rank runs it as it is; the lockstep version runs
each rank from the same generator state, so the generator advances once.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tess_compile.core.layout import Layout, Partial, Replicate, Shard, local_block
from tess_compile.core.mesh import Mesh
from tess_compile.ops.collectives import Comm, current_comm

__all__ = [
    "KINDS",
    "LOCKSTEP",
    "block_spec",
    "contiguous_stride",
    "dropout_draw",
    "full_draw",
    "lockstep_attention",
    "lockstep_dropout",
    "lockstep_native_dropout",
    "lockstep_replicated_draw",
    "replicated_draw",
    "sharded_attention",
    "sharded_dropout",
    "sharded_native_dropout",
]

aten = torch.ops.aten

# What a draw makes: "noise" (aten.dropout's scaled mask, in x's dtype), "mask"
# (aten.native_dropout's keep mask, bool), "bits" (a bare bernoulli_(prob) draw).
KINDS = ("noise", "mask", "bits")


def contiguous_stride(shape) -> list[int]:
    """The strides of a contiguous tensor of `shape`."""
    stride, step = [], 1
    for size in reversed(list(shape)):
        stride.append(step)
        step *= max(size, 1)
    return stride[::-1]


def block_spec(layout: Layout, shape, mesh: Mesh) -> tuple[list[int], list[int], list[int]]:
    """`(split_dims, split_groups, local_shape)` of a tensor of global `shape` under
    `layout`: per mesh axis the dim it splits (-1: none) and its groups."""
    if any(isinstance(p, Partial) for p in layout.placements):
        raise AssertionError(f"a random draw cannot hold partial sums ({layout})")
    dims = [p.dim if isinstance(p, Shard) else -1 for p in layout.placements]
    groups = [p.groups if isinstance(p, Shard) else 1 for p in layout.placements]
    return dims, groups, layout.local_shape(shape, mesh)


def _layout(split_dims, split_groups) -> Layout:
    return Layout(*(Shard(dim, g) if dim >= 0 else Replicate() for dim, g in zip(split_dims, split_groups)))


def _block(full: torch.Tensor, split_dims, split_groups, mesh: Mesh, rank: int) -> torch.Tensor:
    """`rank`'s block of the full draw (a view)."""
    return local_block(full, _layout(split_dims, split_groups), mesh, rank)


def full_draw(kind: str, prob: float, shape, stride, dtype: torch.dtype, device) -> torch.Tensor:
    """The draw of the unsharded op on a tensor of global `shape` and `stride` (see the
    module docstring). `prob` is the drop probability p for "noise" and "mask", the
    Bernoulli probability for "bits"."""
    if kind == "bits":
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).bernoulli_(prob)
    if torch.device(device).type != "cpu":  # the op itself, on ones: its output is its noise
        ones = torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(1)
        if kind == "noise":
            return aten.dropout.default(ones, prob, True)
        return aten.native_dropout.default(ones, prob, True)[1]
    keep = 1 - prob  # as torch computes it, in double
    if kind == "mask":
        return torch.empty_strided(shape, stride, dtype=torch.bool, device=device).bernoulli_(keep)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).bernoulli_(keep).div_(keep)


def _rank_of(comm: Comm) -> int:
    """This rank's number in the mesh, from a communicator that speaks for one rank."""
    if getattr(comm, "meetings", None) is not None:
        raise ValueError(
            "dropout in train mode cannot run under tess_compile.simulate(..., compile=True): its ranks run in "
            "threads of one process and share one random generator, so they would draw different masks; "
            "simulate with compile=False, or run tess_compile.shard(..., compile=True) on real processes"
        )
    rank = getattr(comm, "rank", None)
    if rank is None:
        raise RuntimeError(f"a per-rank dropout draw ran under {type(comm).__name__}, which speaks for no single rank")
    return rank


_DRAW_SCHEMA = ("(Tensor like, str kind, float prob, int[] shape, int[] stride, int[] split_dims, "
                "int[] split_groups, int[] local_shape) -> Tensor")


def _dropout_draw(like, kind, prob, shape, stride, split_dims, split_groups, local_shape):
    dtype = torch.bool if kind == "mask" else like.dtype
    if like.is_meta:
        return like.new_empty(local_shape, dtype=dtype)
    comm = current_comm()
    full = full_draw(kind, prob, shape, stride, like.dtype, like.device)
    block = _block(full, split_dims, split_groups, comm.mesh, _rank_of(comm))
    if block.shape == full.shape and full.is_contiguous():
        return full
    return block.clone(memory_format=torch.contiguous_format)  # contiguous, as the fake kernel; frees the full draw


def _dropout_draw_fake(like, kind, prob, shape, stride, split_dims, split_groups, local_shape):
    return like.new_empty(local_shape, dtype=torch.bool if kind == "mask" else like.dtype)


# This rank's block of the full draw (see `full_draw`). A custom op: compiled graphs
# call it as it is, and never recompute it (it is seeded: a second call draws anew).
dropout_draw = torch.library.custom_op(
    "tess::dropout_draw", _dropout_draw, mutates_args=(), schema=_DRAW_SCHEMA, tags=(torch.Tag.nondeterministic_seeded,)
)
dropout_draw.register_fake(_dropout_draw_fake)
# `like` gives only a dtype and a device: no gradient flows through a draw.
dropout_draw.register_autograd(lambda ctx, grad: (None,) * 8)
dropout_draw = torch.ops.tess.dropout_draw.default


def _lockstep_blocks(comm: Comm, kind, prob, shape, stride, split_dims, split_groups, like) -> list[torch.Tensor]:
    """Every rank's block of one full draw."""
    full = full_draw(kind, prob, shape, stride, like.dtype, like.device)
    return [_block(full, split_dims, split_groups, comm.mesh, r) for r in range(comm.mesh.num_ranks)]


def _native_scale(p: float) -> float:
    keep = 1 - p
    return 0.0 if keep == 0 else 1.0 / keep


class _MaskedScale(torch.autograd.Function):
    """native_dropout's arithmetic, as torch's CPU kernel does it: `x * (mask * scale)` in x's
    dtype; backward `native_dropout_backward(grad, mask, scale)`."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * (mask.to(x.dtype) * scale)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return aten.native_dropout_backward.default(grad, mask, ctx.scale), None, None


def sharded_dropout(x, p, inplace, shape, stride, split_dims, split_groups, local_shape) -> torch.Tensor:
    """`aten.dropout(x, p, True)` (`dropout_` if `inplace`) on this rank's block `x` of a value of
    global `shape`: the unsharded model's mask (a graph target)."""
    noise = dropout_draw(x, "noise", p, shape, stride, split_dims, split_groups, local_shape)
    return x.mul_(noise) if inplace else x.mul(noise)


def lockstep_dropout(comm: Comm, xs, p, inplace, shape, stride, split_dims, split_groups, local_shape) -> list:
    """`sharded_dropout` over every rank's tensor: one full draw."""
    noises = _lockstep_blocks(comm, "noise", p, shape, stride, split_dims, split_groups, xs[0])
    return [x.mul_(noise) if inplace else x.mul(noise) for x, noise in zip(xs, noises)]


def sharded_native_dropout(x, p, shape, stride, split_dims, split_groups, local_shape) -> tuple:
    """`aten.native_dropout(x, p, True)` on this rank's block `x`: (output, bool mask) (a graph target)."""
    mask = dropout_draw(x, "mask", p, shape, stride, split_dims, split_groups, local_shape)
    return _MaskedScale.apply(x, mask, _native_scale(p)), mask


def lockstep_native_dropout(comm: Comm, xs, p, shape, stride, split_dims, split_groups, local_shape) -> list:
    """`sharded_native_dropout` over every rank's tensor: one full draw."""
    masks = _lockstep_blocks(comm, "mask", p, shape, stride, split_dims, split_groups, xs[0])
    return [(_MaskedScale.apply(x, mask, _native_scale(p)), mask) for x, mask in zip(xs, masks)]


class _ReplaceDraw(TorchDispatchMode):
    """Under it, the dropout draws of torch's ops are `draw(kind, tensor, prob)`: an eager
    `bernoulli_(prob)` fills its tensor with kind "bits"; a `native_dropout(t, p, True)`
    (what dropout becomes when a compiler traces it) is `t * noise` with kind "noise".
    `count` counts them."""

    def __init__(self, draw):
        super().__init__()
        self.draw, self.count = draw, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.bernoulli_.float:
            self.count += 1
            target, prob = args[0], (args[1] if len(args) > 1 else kwargs.get("p", 0.5))
            return target.copy_(self.draw("bits", target, prob))
        if func is aten.native_dropout.default and args[2] is not False:
            self.count += 1
            noise = self.draw("noise", args[0], args[1])
            return args[0] * noise, noise.bool()
        return func(*args, **kwargs)


def _attention(draw, where, shape, local_shape, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's scaled_dot_product_attention on local blocks, its one dropout draw made by `draw`."""

    def checked_draw(kind, target, prob):
        if list(target.shape) != list(local_shape) or not target.is_contiguous():
            raise RuntimeError(f"scaled_dot_product_attention at {where} drew a mask of shape {list(target.shape)}, "
                               f"not the contiguous {list(local_shape)} of the attention weights {list(shape)}")
        return draw(kind, target, prob)

    swap = _ReplaceDraw(checked_draw)
    with swap:
        out = aten.scaled_dot_product_attention.default(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                        enable_gqa=enable_gqa)
    if swap.count != 1:
        raise ValueError(
            f"scaled_dot_product_attention(dropout_p={dropout_p}) at {where} on {q.device} (query {list(q.shape)} "
            f"of this rank) made {swap.count} dropout draws, not the one of torch's math path: its mask comes from "
            "a fused kernel, which a rank cannot draw for the whole attention and keep its block of. Set the "
            "attention dropout to 0 (attn_pdrop / attention_dropout = 0.0) or use eager attention "
            "(attn_implementation='eager'), whose dropout is an ordinary dropout"
        )
    return out


def sharded_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, shape, split_dims, split_groups,
                      local_shape, where) -> torch.Tensor:
    """`aten.scaled_dot_product_attention` with `dropout_p > 0` on this rank's blocks: the dropout
    mask is this rank's block of the unsharded model's, whose attention weights have global
    `shape` (a graph target). `where` is the op's model source line, for errors."""

    def draw(kind, target, prob):
        return dropout_draw(target, kind, prob, shape, contiguous_stride(shape), split_dims, split_groups, local_shape)

    return _attention(draw, where, shape, local_shape, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def lockstep_attention(comm: Comm, qs, ks, vs, attn_masks, dropout_p, is_causal, scale, enable_gqa, shape,
                       split_dims, split_groups, local_shape, where) -> list:
    """`sharded_attention` over every rank's tensors: the mask is drawn once, at rank 0's draw."""
    full: dict[str, torch.Tensor] = {}

    def draw_of(rank):
        def draw(kind, target, prob):
            if kind not in full:
                full[kind] = full_draw(kind, prob, shape, contiguous_stride(shape), target.dtype, target.device)
            return _block(full[kind], split_dims, split_groups, comm.mesh, rank)

        return draw

    masks = attn_masks if attn_masks is not None else [None] * len(qs)
    return [_attention(draw_of(r), where, shape, local_shape, qs[r], ks[r], vs[r], masks[r], dropout_p, is_causal,
                       scale, enable_gqa) for r in range(len(qs))]


def _op(name: str):
    """The OpOverload named `name` ("aten.rand.default")."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def replicated_draw(op_name: str, args: tuple, kwargs: dict, node_args: tuple, node_kwargs: tuple):
    """Random op `op_name` whose inputs and output are whole on every rank, run as it is: every
    rank has the same seed, so every rank draws the unsharded model's values (a graph target).
    `node_args` / `node_kwargs` say which arguments are values of the graph."""
    return _op(op_name)(*args, **kwargs)


def _generator_states() -> list:
    """(set_state, state) of the CPU generator and, once CUDA is in use, of CUDA's."""
    states = [(torch.set_rng_state, torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append((torch.cuda.set_rng_state_all, torch.cuda.get_rng_state_all()))
    return states


def lockstep_replicated_draw(comm: Comm, op_name, args, kwargs, node_args, node_kwargs) -> list:
    """`replicated_draw` over every rank's values: each rank draws from the same generator
    state, so each draws the unsharded model's values and the generator advances once."""
    op, states = _op(op_name), _generator_states()
    outs = []
    for rank in range(comm.mesh.num_ranks):
        for set_state, state in states:
            set_state(state)
        rank_args = [a[rank] if i in node_args else a for i, a in enumerate(args)]
        rank_kwargs = {k: (v[rank] if k in node_kwargs else v) for k, v in kwargs.items()}
        outs.append(op(*rank_args, **rank_kwargs))
    return outs


# Graph targets by their versions over every rank's tensors (the simulator's lockstep).
LOCKSTEP = {
    sharded_dropout: lockstep_dropout,
    sharded_native_dropout: lockstep_native_dropout,
    sharded_attention: lockstep_attention,
    replicated_draw: lockstep_replicated_draw,
}
