"""Layouts as DTensor placements, parameters' local tensors, and the global value of a sharded
module's DTensor output.

A layout maps one-to-one onto DTensor placements on the `(depth, row, col)`
mesh; a grouped split `S(dim, g)` is DTensor's `_StridedShard`. `local_tensors`
gives the per-rank program its parameters' local tensors through one autograd
node per call, whose backward puts their gradients into `.grad` itself where
autograd's AccumulateGrad would only store or add them (a gradient shared with
another tensor is copied first). `full_tensor` gathers an output in one
all-gather over all ranks, under the module's timeout.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch
from torch.distributed import tensor as dt
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import _StridedShard

from tess_compile.core.layout import Layout, Partial, Replicate, Shard, assemble, local_block, pad_block, unpad_block
from tess_compile.core.mesh import Mesh
from tess_compile.runtime.groups import world_of

__all__ = [
    "GatherFull",
    "claim_output_gradient",
    "contiguous_stride",
    "full_from_local",
    "full_tensor",
    "gradient_dtensor",
    "layout_of",
    "local_tensors",
    "output_dtensor",
    "output_spec",
    "placements_of",
    "tess_mesh",
]


def placements_of(layout: Layout) -> tuple:
    """DTensor placements of `layout`. A grouped split `S(dim,g=g)` over n ranks is
    `_StridedShard(dim, split_factor=g)`: both give coordinate i the chunks i, n+i, ...
    of the dim cut into n*g."""

    def convert(placement):
        if isinstance(placement, Shard):
            return dt.Shard(placement.dim) if placement.groups == 1 else _StridedShard(placement.dim, split_factor=placement.groups)
        return dt.Partial() if isinstance(placement, Partial) else dt.Replicate()

    return tuple(convert(p) for p in layout.placements)


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def layout_of(placements) -> Layout:
    """The Layout of DTensor placements on the (depth, row, col) mesh (inverse of `placements_of`)."""

    def convert(placement):
        if isinstance(placement, _StridedShard):
            return Shard(placement.dim, groups=placement.split_factor)
        if isinstance(placement, dt.Shard):
            return Shard(placement.dim)
        return Partial() if placement.is_partial() else Replicate()

    return Layout(*(convert(p) for p in placements))


def tess_mesh(device_mesh) -> Mesh | None:
    """The Mesh of a sharded module's DeviceMesh; None for any other DeviceMesh."""
    world = world_of(device_mesh)
    return None if world is None else world.mesh


def local_tensors(values: Sequence) -> list:
    """`values`, each DTensor as its local tensor (the very storage: copying into it loads the DTensor).

    Where grad mode is on, the local tensors of the DTensors that require grad come from one
    autograd node. Its backward gives each DTensor the gradient `DTensor.to_local()`'s would: a
    DTensor of its global shape and placements (Partial ones as Replicate), accumulated into
    `.grad` as autograd's AccumulateGrad would (`_accumulate`), or handed to autograd where
    something else must see it. `to_local()` makes one node per DTensor and validates a new
    spec per gradient; torch's AccumulateGrad dispatches a DTensor `detach` per gradient.
    """
    out = list(values)
    tracked = []  # positions of the DTensors that require grad (grad mode on)
    grad_mode = torch.is_grad_enabled()
    for index, x in enumerate(out):
        if isinstance(x, DTensor):
            if grad_mode and x.requires_grad:
                tracked.append(index)
            else:
                out[index] = x._local_tensor.view_as(x._local_tensor)
    if tracked:
        for index, local in zip(tracked, _LocalTensors.apply(*(out[i] for i in tracked))):
            out[index] = local
    return out


class _LocalTensors(torch.autograd.Function):
    """DTensors' local tensors; backward: each gradient as a DTensor with its DTensor's spec,
    accumulated into a leaf's `.grad` here where autograd's AccumulateGrad would do just that."""

    @staticmethod
    def forward(ctx, *dtensors):
        ctx.specs = [x._spec for x in dtensors]
        ctx.set_materialize_grads(False)
        # Fresh tensor objects: autograd writes its metadata into them, not into the DTensors' own.
        return tuple(x._local_tensor.view_as(x._local_tensor) for x in dtensors)

    @staticmethod
    def backward(ctx, *grads):
        if not isinstance(ctx, torch.autograd.function.BackwardCFunction) or torch.compiler.is_compiling():
            # Compiled autograd runs this in its own graph, with a stand-in `ctx` (and Dynamo may trace
            # it): the gradients go to its AccumulateGrad, as DTensors of DTensor's own constructor.
            return tuple(None if g is None else _as_gradient(g, spec, DTensor) for g, spec in zip(grads, ctx.specs))
        leaves = _accumulating_leaves(ctx)
        if leaves is None:  # nothing accumulates: the gradients are returned or recorded
            return tuple(None if g is None else _as_gradient(g, spec) for g, spec in zip(grads, ctx.specs))
        claimed, (bases, views) = _claimed(), _view_bases(grads)
        out = []
        for grad, base, spec, leaf in zip(grads, bases, ctx.specs, leaves):
            if grad is None:
                out.append(None)
                continue
            if not _owned(grad, base, claimed, views):
                grad = grad.clone()  # another gradient, or a tensor alive elsewhere, shares its memory
            _claim(claimed, grad)
            out.append(None if leaf is not None and _accumulate(leaf, grad, spec) else _as_gradient(grad, spec))
        return tuple(out)


_ACCUMULATE_GRAD = type(torch.empty(0, requires_grad=True).view_as(torch.empty(0)).grad_fn.next_functions[0][0])


def _accumulating_leaves(ctx) -> list | None:
    """For each input of the node `ctx`, the leaf whose `.grad` this backward accumulates its gradient
    into, or None (a non-leaf input, a leaf outside `backward(inputs=...)`). None for all where no
    `.grad` takes a gradient as it is: under `create_graph` (recorded) and `torch.autograd.grad`."""
    if torch.is_grad_enabled():
        return None
    leaves = []
    for node, _ in ctx.next_functions:
        if type(node) is not _ACCUMULATE_GRAD:
            leaves.append(None)
            continue
        try:
            executes = torch._C._will_engine_execute_node(node)
        except RuntimeError:  # raised for a leaf under torch.autograd.grad, which accumulates nothing
            return None
        leaves.append(node.variable if executes else None)
    return leaves


# Per running backward (autograd's graph task id): the gradients that a `.grad` took
# (`_LocalTensors`) or that entered a program from outside, at an output (`claim_output_gradient`),
# by id, each with a weak reference (an id is unique only while its tensor lives). A `.grad` takes
# none of them, nor a view of one. The newest few backwards are kept (several can run at once).
_CLAIMS: dict[int, dict[int, weakref.ref]] = {}
_MAX_CLAIMS = 8


def _claimed() -> dict[int, weakref.ref]:
    task = torch._C._current_graph_task_id()
    claimed = _CLAIMS.get(task)
    if claimed is None:
        if len(_CLAIMS) >= _MAX_CLAIMS:
            del _CLAIMS[min(_CLAIMS)]
        claimed = _CLAIMS[task] = {}
    return claimed


def _claim(claimed: dict[int, weakref.ref], tensor: torch.Tensor) -> None:
    claimed[id(tensor)] = weakref.ref(tensor)


def _is_claimed(claimed: dict[int, weakref.ref], tensor: torch.Tensor) -> bool:
    ref = claimed.get(id(tensor))
    return ref is not None and ref() is tensor


def claim_output_gradient(grad: torch.Tensor) -> torch.Tensor:
    """Mark `grad`, the gradient of a program's output, as not autograd's own to give away: a
    parameter's gradient that is `grad` itself or a view of it (an output that is a parameter plus
    something) is copied before a `.grad` takes it. The caller may hold `grad` and use it again."""
    _claim(_claimed(), grad)
    return grad


def _view_bases(grads: Sequence) -> tuple[list, dict[int, int]]:
    """Each gradient's base (None where it is not a view), and for each base, id(base) -> how many of
    `grads` are views of it, 0 where two of them overlap (a gradient bucket's pieces are views of one
    buffer that do not)."""
    bases, groups = [], {}
    for grad in grads:
        base = grad._base if grad is not None and grad._is_view() else None
        bases.append(base)
        if base is not None:
            groups.setdefault(id(base), []).append(grad)
    return bases, {key: len(views) if len(views) == 1 or _disjoint(views) else 0 for key, views in groups.items()}


def _disjoint(views: list[torch.Tensor]) -> bool:
    """Whether the views' spans of their storage (first element to last) are pairwise apart (one view
    listed twice is not apart from itself)."""
    spans = []
    for view in views:
        if view.numel():
            last = view.storage_offset() + sum((size - 1) * step for size, step in zip(view.shape, view.stride()))
            spans.append((view.storage_offset(), last))
    spans.sort()
    return all(end < start for (_, end), (start, _) in itertools.pairwise(spans))


def _owned(grad: torch.Tensor, base: torch.Tensor | None, claimed: dict[int, weakref.ref],
           views: dict[int, int]) -> bool:
    """Whether `.grad` may take `grad` and add to it in place later: no other tensor uses its storage,
    but its base if it is a view (which autograd keeps alive) and other views of that base among this
    node's gradients that do not overlap it (`views`), and neither it nor its base is claimed. (torch's AccumulateGrad
    counts the references to the gradient alone, so two overlapping views of one gradient can become
    two leaves' `.grad`.) Counted: the storage object made here, `grad`, a base and its views."""
    if _is_claimed(claimed, grad):
        return False
    uses = torch._C._storage_Use_Count(grad.untyped_storage()._cdata)
    if base is None:
        return uses == 2
    return views[id(base)] > 0 and uses == views[id(base)] + 2 and not _is_claimed(claimed, base)


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor, spec: DTensorSpec) -> bool:
    """Accumulate `grad` (owned: `_owned`) into the DTensor leaf's `.grad`, as AccumulateGrad would
    without grad mode: `.grad` takes it (in the leaf's local strides), or it is added in place. False,
    and nothing done, where AccumulateGrad must see it: the leaf has hooks (autograd calls them around
    the accumulation), no longer requires grad (AccumulateGrad drops the gradient), or has a `.grad`
    of other placements. A hook on the leaf's AccumulateGrad node still runs, after this: autograd
    calls that node with no gradient, and `.grad` is already in place."""
    if leaf._backward_hooks or leaf._post_accumulate_grad_hooks or not leaf.requires_grad:
        return False
    held = leaf.grad
    if held is None:
        local = leaf._local_tensor
        if grad.stride() != local.stride() and grad.numel() > 1:
            grad = torch.empty_like(local).copy_(grad)  # the gradient layout contract: the parameter's strides
        leaf.grad = _as_gradient(grad, spec)
        return True
    if type(held) is DTensor and held._spec.placements == _gradient_spec(spec, grad).placements:
        held._local_tensor.add_(grad)
        return True
    return False


# (id(spec), local gradient's shape, stride, dtype) -> (spec, its gradients' spec).
_GRAD_SPECS: dict[tuple, tuple[DTensorSpec, DTensorSpec]] = {}
_MAX_GRAD_SPECS = 4096

# `DTensor(local, spec, requires_grad=...)` without `DTensor.__init__`, which only calls
# `Tensor.__init__` through a `torch._disable_dynamo` wrapper (a microsecond a gradient);
# `__new__` (torch's C++ `_dtensor__new__`) makes the whole DTensor.
_new_dtensor = DTensor.__new__


def _gradient_spec(spec: DTensorSpec, grad: torch.Tensor) -> DTensorSpec:
    """The spec of the gradient `grad` of the local tensor of a DTensor of `spec`, as `to_local()`'s
    backward gives it; built once per DTensor and gradient stride and shared by its gradients (never
    the DTensor's own spec, as in torch): nothing is validated again, and DTensor's sharding cache
    finds it by identity."""
    key = (id(spec), grad.shape, grad.stride(), grad.dtype)
    known = _GRAD_SPECS.get(key)
    if known is None:
        if len(_GRAD_SPECS) >= _MAX_GRAD_SPECS:
            _GRAD_SPECS.clear()
        known = _GRAD_SPECS[key] = (spec, _grad_spec(spec, grad))  # holding `spec` keeps its id unique
    return known[1]


def _as_gradient(grad: torch.Tensor, spec: DTensorSpec, make=None) -> DTensor:
    """`grad`, the gradient of the local tensor of a DTensor of `spec`, as that DTensor's gradient
    (`_gradient_spec`), `grad` itself its local tensor (torch's `from_local` makes a view): a
    gradient gets no autograd metadata written into it, and AccumulateGrad stores a detached copy
    of this DTensor. `make`: DTensor's own constructor, for compiled autograd (which Dynamo may trace)."""
    if make is not None:
        return make(grad, _gradient_spec(spec, grad), requires_grad=grad.requires_grad)
    return _new_dtensor(DTensor, grad, _gradient_spec(spec, grad), requires_grad=grad.requires_grad)


def gradient_dtensor(grad: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """`grad`, a gradient of the local tensor of a DTensor of `spec`, as that DTensor's gradient
    (`grad` itself its local tensor; placed as `to_local()`'s backward places it)."""
    return _as_gradient(grad, spec)


def _grad_spec(spec: DTensorSpec, grad: torch.Tensor) -> DTensorSpec:
    """The spec of a DTensor's gradient as `to_local()`'s backward gives it (through `from_local`):
    the DTensor's shape, the stride of `grad` scaled to it, Partial placements made Replicate."""
    _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
    placements = tuple(dt.Replicate() if p.is_partial() else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=TensorMeta(spec.shape, tuple(stride), grad.dtype))


def output_spec(device_mesh, placements: tuple, shape: Sequence[int], dtype: torch.dtype) -> DTensorSpec:
    """The spec of an output DTensor of global `shape` (contiguous strides), as `DTensor.from_local`
    builds it; made once per output and shared by its DTensors (see `output_dtensor`)."""
    shape = torch.Size(shape)
    return DTensorSpec(device_mesh, tuple(placements), tensor_meta=TensorMeta(shape, contiguous_stride(shape), dtype))


def output_dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """`DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=..., stride=...)`
    with the spec given (`output_spec`): the same DTensor and the same backward (the gradient
    redistributed to the placements, Partial ones as Replicate, then its local tensor), without
    building and validating a spec on every call. `local` is on the mesh's device type."""
    if torch.is_grad_enabled() and local.requires_grad:
        return _AsOutput.apply(local, spec)
    return _new_dtensor(DTensor, local.detach(), spec, requires_grad=False)  # as from_local gives it, unrecorded


class _AsOutput(torch.autograd.Function):
    """`output_dtensor` where autograd records it: torch's `_FromTorchTensor` with a given spec."""

    @staticmethod
    def forward(ctx, local, spec):
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return _new_dtensor(DTensor, local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        spec = ctx.spec
        placements = tuple(dt.Replicate() if p.is_partial() else p for p in spec.placements)
        if grad.placements != placements:
            target = DTensorSpec(spec.mesh, placements, tensor_meta=grad._spec.tensor_meta)
            return redistribute_local_tensor(grad._local_tensor, grad._spec, target), None
        # torch returns `grad.to_local()`: a view of the same storage, recorded only for double backward
        return claim_output_gradient(grad.to_local() if torch.is_grad_enabled() else grad._local_tensor), None


def full_tensor(x):
    """The global value of `x`, a DTensor output of a sharded module, on every rank.

    One all-gather over all ranks, under the module's timeout (a failure names
    the op and this rank), where `x.full_tensor()` runs one per split dim (on a
    mesh without the flattened axes, one per axis, and torch logs a warning on
    every rank). Differentiable like `x.full_tensor()`: each rank's gradient is
    its block of the (replicated) gradient. A DTensor on another mesh goes
    through `x.full_tensor()`; other values come back as they are.
    """
    if not isinstance(x, DTensor):
        return x
    world = world_of(x.device_mesh)
    if world is None:
        return x.full_tensor()
    return GatherFull.apply(x.to_local(), world, layout_of(x.placements), tuple(x.shape))


def full_from_local(local: torch.Tensor, world, layout: Layout, shape) -> torch.Tensor:
    """The global value of `shape` from this rank's true block `local` of an output laid out by
    `layout` over `world`, differentiable as `full_tensor` (which this is, without the DTensor);
    `local` itself on a world of one."""
    if world.size == 1:
        return local
    return GatherFull.apply(local, world, layout, tuple(shape))


class GatherFull(torch.autograd.Function):
    """Every rank's local tensor gathered and assembled; backward: this rank's block."""

    @staticmethod
    def forward(ctx, local, world, layout, shape):
        ctx.world, ctx.layout = world, layout
        return gather_blocks(world, local, layout, shape, "full_tensor")

    @staticmethod
    def backward(ctx, grad):
        summed = [Replicate() if isinstance(p, Partial) else p for p in ctx.layout.placements]
        return local_block(grad, Layout(*summed), ctx.world.mesh, ctx.world.rank).contiguous(), None, None, None


def gather_blocks(world, local: torch.Tensor, layout: Layout, shape, op: str) -> torch.Tensor:
    """The global tensor of `shape` from this rank's true block `local` (laid out by `layout`) and
    every other rank's, in one all-gather over `world` (blocks of uneven splits padded to one size
    for it, and cut back)."""
    mesh = world.mesh
    padded = pad_block(local, layout, shape, mesh)
    blocks = world.all_gather(padded, op)
    if layout.uneven_dims(shape, mesh):  # else every block is its rank's true block
        blocks = [unpad_block(block, layout, shape, mesh, r) for r, block in enumerate(blocks)]
    return assemble(blocks, layout, mesh)
