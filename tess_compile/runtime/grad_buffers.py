"""A sharded module's gradients as views into one flat buffer per dtype, for a whole training step.

`GradBuffers` gives each DTensor parameter that requires grad a persistent leaf: a plain
tensor that is its local tensor (the very storage, detached) and requires grad. The per-rank
graph takes the leaves in place of the parameters (`ShardedModule.holding_leaves`), so
autograd's own AccumulateGrad adds each gradient into the leaf's `.grad`, a view into the
flat buffer of its dtype, in place: no Python per parameter in backward. Each parameter's
`.grad` is a DTensor whose local tensor is that same view (placed as `to_local()`'s backward
places it), so `parameters()`, `clip_grad_norm_`, optimizers and DCP see the gradients as
they always do. This is DistributedDataParallel's `gradient_as_bucket_view`. Within a buffer
the parameters are ordered by how many ranks of the tensor-parallel mesh hold the same block
(`replicas`), so a norm over the whole model is one reduction per run of equal counts.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from tess_compile.runtime.dtensors import gradient_dtensor

__all__ = ["GradBuffers", "replicas"]


def replicas(param: DTensor) -> int:
    """How many ranks of the parameter's mesh hold the same block of it: the sizes of the mesh
    dims it is replicated over (a gradient's Partial placements are Replicate; a grouped split,
    `_StridedShard`, is a split)."""
    return math.prod(size for size, placement in zip(param.device_mesh.shape, param.placements)
                     if placement.is_replicate() or placement.is_partial())


class GradBuffers:
    """The leaves and flat gradient buffers of `params` (DTensors that require grad; each once).

    `leaf_of`: id(parameter) -> its leaf. `flats`: one buffer per (dtype, device). `runs`: per
    buffer, `(replicas, start, end)` for each run of parameters of one replica count.
    Where the gradients have no place in a buffer (a local tensor that is not dense), the
    leaf's `.grad` is a tensor of its own, listed in `loose`.
    """

    def __init__(self, params: list[DTensor]):
        self.params = params
        self.leaves = [p._local_tensor.detach().requires_grad_() for p in params]
        self.leaf_of = {id(p): leaf for p, leaf in zip(params, self.leaves)}
        self.views: list[torch.Tensor | None] = [None] * len(params)  # each leaf's gradient, held or not
        self.unreached: list[int] = []  # leaves the loss does not reach (`keep_reached`): `.grad` None
        self.flats: list[torch.Tensor] = []
        self.runs: list[list[tuple[int, int, int]]] = []
        self.loose: list[tuple[int, torch.Tensor]] = []  # (replicas, gradient) outside the buffers
        by_kind: dict[tuple, list[int]] = {}
        for index, leaf in enumerate(self.leaves):
            if _dense(leaf):
                by_kind.setdefault((leaf.dtype, leaf.device), []).append(index)
            else:
                grad = torch.zeros_like(leaf)
                self.loose.append((replicas(params[index]), grad))
                self._attach(index, grad)
        for (dtype, device), members in by_kind.items():
            members.sort(key=lambda i: replicas(params[i]))
            flat = torch.zeros(sum(self.leaves[i].numel() for i in members), dtype=dtype, device=device)
            runs, offset = [], 0
            for index in members:
                leaf = self.leaves[index]
                self._attach(index, flat.as_strided(leaf.shape, leaf.stride(), offset))
                count = replicas(params[index])
                if runs and runs[-1][0] == count:
                    runs[-1] = (count, runs[-1][1], offset + leaf.numel())
                else:
                    runs.append((count, offset, offset + leaf.numel()))
                offset += leaf.numel()
            self.flats.append(flat)
            self.runs.append(runs)

    def _attach(self, index: int, grad: torch.Tensor) -> None:
        self.views[index] = self.leaves[index].grad = grad
        self.params[index].grad = gradient_dtensor(grad, self.params[index]._spec)

    def keep_reached(self, loss: torch.Tensor) -> None:
        """Leave `.grad` None on the leaves (and parameters) that `loss` does not reach, as autograd
        does: an optimizer steps no parameter without a gradient."""
        reached = _reached_leaves(loss)
        self.unreached = [i for i, leaf in enumerate(self.leaves) if id(leaf) not in reached]
        for index in self.unreached:
            self.leaves[index].grad = self.params[index].grad = None

    def adopt_late(self) -> None:
        """After backward: a leaf that `keep_reached` found unreached but that took a gradient now has
        it in its view again."""
        for index in [i for i in self.unreached if self.leaves[i].grad is not None]:
            self.views[index].copy_(self.leaves[index].grad)
            self._attach(index, self.views[index])
            self.unreached.remove(index)

    def zero_(self) -> None:
        """Every gradient to zero (in place: the views stay the parameters' `.grad`)."""
        for tensor in self.tensors():
            tensor.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """The flat buffers and the loose gradients: every gradient element once."""
        return self.flats + [grad for _, grad in self.loose]

    def norm_share(self, norm_type: float) -> torch.Tensor:
        """This rank's share of the whole model's gradient norm, in float64: for a p-norm the sum of
        |g|^p over its elements, each divided by its number of replicas (the sum over all ranks counts
        every element of the model once); for `inf`, the largest |g|."""
        pieces = [(count, flat[start:end]) for flat, runs in zip(self.flats, self.runs) for count, start, end in runs]
        pieces += [(count, grad.reshape(-1)) for count, grad in self.loose]
        values = []
        for count, piece in pieces:
            norm = torch.linalg.vector_norm(piece, norm_type).double()
            values.append(norm if math.isinf(norm_type) else norm.pow(norm_type) / count)
        if not values:
            return torch.zeros((), dtype=torch.float64)
        stacked = torch.stack(values)
        return stacked.max() if math.isinf(norm_type) else stacked.sum()


def _reached_leaves(loss: torch.Tensor) -> set[int]:
    """The ids of the leaves whose AccumulateGrad nodes backward from `loss` reaches."""
    found, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return found


def _dense(tensor: torch.Tensor) -> bool:
    return torch._prims_common.is_non_overlapping_and_dense_or_false(tensor)
