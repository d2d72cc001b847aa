"""Selective recompute regions: an analysis of the per-rank graph.

`mark_selective` makes each run of two or more consecutive cheap local ops
(pointwise, views, the local parts of norms, softmax) one recompute region
(`RECOMPUTE_REGION` = "selective N") where that saves memory; matrix
products (the `saved` records of `tess_compile.core.product_table`), attention,
lookups and collectives are saved, as torch's selective
activation checkpointing policies save matmul outputs, so a region
recomputes without communicating. A region saves its inputs and frees what
its own ops would save inside it; a fake run of the graph prices both, a run
is kept only where it frees more than it adds, and the runs kept are dropped
again if together they do not lower the bytes saved. (With the memory-lean
products and norms a transformer block keeps little that such runs free.)
Nodes already in a region keep theirs. Reads `RECOMPUTE_REGION` and `SUMMA_STEP` (a product's
steps are saved); writes `RECOMPUTE_REGION` (`tess_compile.core.meta_keys`).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node

from tess_compile.core.fake_run import placeholder_values, tensor_leaves
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import RECOMPUTE_REGION, SUMMA_STEP
from tess_compile.core.product_table import product_kernel
from tess_compile.ops.collectives import COLLECTIVE_OPS, wait
from tess_compile.ops.context_attention import context_attention
from tess_compile.ops.fetched_product import fetched_product
from tess_compile.ops.ring_attention import ring_attention
from tess_compile.ops.recompute_region import outline_regions

__all__ = ["mark_selective", "saves_output"]

aten = torch.ops.aten


# Ops besides the products (`product_kernel`) whose outputs the selective policy saves: convolutions,
# einsum, attention, lookups, a fetched product and an arrived broadcast.
_SAVED_OPS = (
    aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.einsum.default,
    aten.embedding.default, aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, fetched_product, context_attention, ring_attention, wait,
)


def _recomputable(node: Node) -> bool:
    return (
        node.op == "call_function"
        and not RECOMPUTE_REGION.has(node)
        and not SUMMA_STEP.has(node)  # a product's steps and their sum
        and node.target not in COLLECTIVE_OPS
        and node.target not in _SAVED_OPS
        and not saves_output(node.target)
    )


def saves_output(target) -> bool:
    """Whether `target` is a product whose output selective recompute keeps (its record's `saved`)."""
    kernel = product_kernel(target)
    return kernel is not None and kernel.saved


def mark_selective(gm: GraphModule, mesh: Mesh) -> GraphModule:
    """Each run of two or more consecutive recomputable nodes that frees more saved
    bytes than it adds becomes a region."""
    runs: list[list[Node]] = [[]]
    for node in gm.graph.nodes:
        if _recomputable(node):
            runs[-1].append(node)
        elif runs[-1]:
            runs.append([])
    saves = _SavedBy.of(gm, mesh)
    chosen = [run for run in runs if len(run) > 1 and saves.frees_more_than_it_adds(run)]
    for number, run in enumerate(chosen):
        for node in run:
            RECOMPUTE_REGION.set(node, f"selective {number}")
    if chosen and _SavedBy.of(outline_regions(gm), mesh).total() >= saves.total():
        for node in (n for run in chosen for n in run):  # together they free nothing: keep the graph as it was
            RECOMPUTE_REGION.pop(node)
    return gm


class _SavedBy(Interpreter):
    """A fake run of the per-rank graph that notes which nodes save which storages."""

    def __init__(self, gm: GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.current: Node | None = None
        self.saved_by: dict[int, set[Node]] = {}
        self.nbytes: dict[int, int] = {}

    @classmethod
    def of(cls, gm: GraphModule, mesh: Mesh) -> _SavedBy:
        run = cls(gm)
        with FakeTensorMode(allow_non_fake_inputs=True):
            inputs = placeholder_values(gm, mesh)
            with torch.autograd.graph.saved_tensors_hooks(run._pack, lambda tensor: tensor):
                run.run(*inputs)
        return run

    def run_node(self, node: Node):
        self.current = node
        return super().run_node(node)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.saved_by.setdefault(storage._cdata, set()).add(self.current)
        self.nbytes[storage._cdata] = storage.nbytes()
        return tensor

    def _storage_bytes(self, node: Node) -> dict[int, int]:
        tensors = tensor_leaves(self.env.get(node))
        return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}

    def total(self) -> int:
        """Bytes of every storage the run saved (parameters included)."""
        return sum(self.nbytes.values())

    def frees_more_than_it_adds(self, run: list[Node]) -> bool:
        """Whether recomputing `run` frees more saved bytes (what only its own nodes save,
        its inputs and its outputs aside: a later consumer, or a later region, may save
        those) than it adds (its inputs that nothing saved)."""
        members = set(run)
        inputs: dict[int, int] = {}
        for arg in dict.fromkeys(a for node in run for a in node.all_input_nodes if a not in members):
            inputs.update(self._storage_bytes(arg))
        outputs = {s for node in run if any(u not in members for u in node.users) for s in self._storage_bytes(node)}
        freed = sum(self.nbytes[s] for s, savers in self.saved_by.items()
                    if s not in inputs and s not in outputs and savers <= members)
        added = sum(num_bytes for s, num_bytes in inputs.items() if s not in self.saved_by)
        return freed > added
