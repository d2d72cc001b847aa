"""The pipeline driver: runs the passes on a model and packs the result.

`compile_model` captures the model, then runs `pipeline(...)` (place,
verify, rewrite, verify), naming the pass that fails. The result, a `Program`, is
what both runtimes execute: the per-rank graph plus, for each of its
placeholders, what feeds it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from passes import capture, place, rewrite, verify_placed, verify_rewritten
from tess_compile.layout import Layout, local_block
from tess_compile.mesh import Mesh

__all__ = ["INPUT_ROLES", "Program", "Slot", "compile_model", "pipeline", "split_example_inputs"]

# Slot roles whose values arrive as the module's inputs on every call.
INPUT_ROLES = ("input", "weight")

log = logging.getLogger("tess_compile")


def pipeline(strict: bool, verify: bool, replicate_outputs: bool = False, summa: str = "broadcast"):
    """The passes after capture, options bound: (name, fn(gm, mesh) -> gm)."""
    stages = [("place", lambda gm, mesh: place(gm, mesh, strict=strict, replicate_outputs=replicate_outputs))]
    if verify:
        stages.append(("verify placed", verify_placed))
    stages.append(("rewrite", lambda gm, mesh: rewrite(gm, mesh, summa=summa)))
    if verify:
        stages.append(("verify rewritten", verify_rewritten))
    return stages



@dataclass(frozen=True)
class Slot:
    """One placeholder of the per-rank graph: a parameter, buffer, constant or input."""

    role: str  # "param", "buffer", "constant", "alias", "input" or "weight" (a weight given as input)
    name: str  # the model's qualified name, or (inputs and weights) the input's index as text
    layout: Layout | None
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    alias_of: str | None = None  # for "alias": the name of the tied tensor


@dataclass
class Program:
    """A compiled model: the per-rank graph and how to feed and read it."""

    mesh: Mesh
    graph: GraphModule
    slots: list[Slot]
    output_layouts: list[Layout | None]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    tensors: dict[str, torch.Tensor]  # the model's parameters, buffers, constants
    state_keys: list[str]  # the model's state-dict keys, in its order

    @property
    def params(self) -> list[Slot]:
        return [s for s in self.slots if s.role == "param"]

    def local_tensor(self, slot: Slot, rank: int, full: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """The block of a parameter/buffer/constant that `rank` holds (a copy, on `device`).

        Of a meta tensor (a model built on the meta device): an uninitialised
        tensor of the local shape, so that the full tensor never exists.
        """
        full = self.tensors[slot.name] if full is None else full
        if full.is_meta:
            return torch.empty(slot.layout.local_shape(slot.shape, self.mesh), dtype=slot.dtype, device=device)
        return local_block(full.detach(), slot.layout, self.mesh, rank).to(device or full.device, copy=True)

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise ValueError(
                f"inputs have structure {spec}, but the module was compiled for {self.in_spec}: "
                "call it with the same arguments as example_inputs"
            )
        for slot, value in zip([s for s in self.slots if s.role in INPUT_ROLES], flat):
            if isinstance(value, torch.Tensor) and tuple(value.shape) != slot.shape:
                raise ValueError(
                    f"input {slot.name} has shape {list(value.shape)}, but the module was compiled for "
                    f"{list(slot.shape)} on mesh {self.mesh}: compile again with example_inputs of this shape"
                )
        return flat


def split_example_inputs(example_inputs) -> tuple[tuple, dict]:
    """`example_inputs` as (args, kwargs): a tensor, a tuple of args, or a dict of kwargs."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise ValueError(
        f"example_inputs is a {type(example_inputs).__name__}: pass a tensor, a tuple of "
        "positional inputs, or a dict of keyword inputs"
    )


def compile_model(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs,
    *,
    strict: bool = False,
    verify: bool | None = None,
    weight_inputs: dict[int, str] | None = None,
    replicate_outputs: bool = False,
    summa: str = "broadcast",
) -> Program:
    """Capture `model` on `example_inputs` and compile it for `mesh`.

    `weight_inputs` and `replicate_outputs` serve graphs whose weights are
    inputs and whose outputs go on as plain tensors (the torch.compile path).
    `summa` schedules the matrix products' steps: "broadcast" (one after
    another), "overlap" (next step's broadcasts in flight) or "gather".
    """
    if verify is None:
        verify = os.environ.get("TESS_COMPILE_DEBUG", "") not in ("", "0")
    args, kwargs = split_example_inputs(example_inputs)
    start = time.perf_counter()
    gm = capture(model, args, kwargs, weight_inputs=weight_inputs)
    dumper = _StageDumper.from_env(mesh)
    dumper.write("capture", None, gm)
    placed = gm
    for name, stage in pipeline(strict, verify, replicate_outputs, summa):
        before = len(gm.graph.nodes)
        try:
            gm = stage(gm, mesh)
        except ValueError:
            raise
        except Exception as err:
            raise RuntimeError(f"tess-compile pass {name!r} failed on mesh {mesh}: {err}") from err
        if name == "place":
            placed = gm
        dumper.write(name, before, gm)
    log.info("compiled %s for mesh %s in %.2fs", type(model).__name__, mesh, time.perf_counter() - start)
    return Program(
        mesh=mesh,
        graph=gm,
        slots=_slots(placed),
        output_layouts=_output_layouts(placed),
        in_spec=gm.meta["in_spec"],
        out_spec=gm.meta["out_spec"],
        tensors=gm.meta["tensors"],
        state_keys=gm.meta["state_keys"],
    )


class _StageDumper:
    """The debug switch: with `TESS_COMPILE_DUMP=folder`, every stage's graph is
    written there pass by pass (rank 0's view), with node counts in `passes.txt`."""

    STAGES = {"capture": "captured", "place": "placed", "rewrite": "rewritten"}

    def __init__(self, folder: str | None, mesh: Mesh):
        self.folder, self.mesh, self.count = folder, mesh, 0

    @classmethod
    def from_env(cls, mesh: Mesh) -> _StageDumper:
        return cls(os.environ.get("TESS_COMPILE_DUMP") or None, mesh)

    def write(self, name: str, nodes_before: int | None, gm: GraphModule) -> None:
        if self.folder is None:
            return
        from tess_compile.graph_dump import dump_graph

        os.makedirs(self.folder, exist_ok=True)
        nodes = len(gm.graph.nodes)
        change = "" if nodes_before is None else f" ({nodes_before} -> {nodes}, {nodes - nodes_before:+d})"
        with open(os.path.join(self.folder, "passes.txt"), "a", encoding="ascii") as summary:
            summary.write(f"{self.count:02d} {name}: {nodes} nodes{change}\n")
        if name in self.STAGES:
            text = dump_graph(gm, self.mesh, stage=self.STAGES[name])
            with open(os.path.join(self.folder, f"{self.count:02d}-{name}.txt"), "w", encoding="ascii") as out:
                out.write(text)
        log.info("pass %s: %d nodes%s", name, nodes, change)
        self.count += 1


def _slots(placed: GraphModule) -> list[Slot]:
    placeholders = [n for n in placed.graph.nodes if n.op == "placeholder"]
    slots = []
    for node in placeholders:
        role, name = node.meta["role"]
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            slots.append(Slot(role, str(name), None, (), None))
            continue
        layout = node.meta["layout"]
        if role == "input":
            role = "weight" if "weight_input" in node.meta else "input"
            layout = Layout.replicated()  # inputs arrive whole
        slots.append(Slot(role, str(name), layout, tuple(val.shape), val.dtype, node.meta.get("alias_of")))
    return slots


def _output_layouts(placed: GraphModule) -> list[Layout | None]:
    output = next(n for n in placed.graph.nodes if n.op == "output")
    needed = output.meta["arg_layouts"]
    return [needed.get(n) if isinstance(n, torch.fx.Node) else None for n in pytree.tree_leaves(output.args[0])]
