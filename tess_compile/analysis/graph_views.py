"""What a graph dump shows: for each stage (`tess_compile.analysis.graph_dump`), one
line per node with its shapes, layout, collectives and peers, a header, and the text
and Graphviz renderings of those lines.

The rewritten stage's header gives the rank's parameter bytes and bytes moved
(`tess_compile.analysis.accounting`); with `sizes=`, also those bytes as
formulas in the model's sizes and the mesh (`tess_compile.analysis.symbolic`).
Text has one node a line (`name = op(args)  # comment`); `#` lines are the
header and, in "placed", the conversions before the node needing them.
Output is deterministic and ASCII.
"""

from __future__ import annotations

import inspect
import operator
import subprocess
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from tess_compile.analysis.accounting import PHASES, CollectiveCost, bytes_by_phase, collective_costs
from tess_compile.analysis.symbolic import format_symbolic, formulas_by_phase, symbolic_costs
from tess_compile.analysis.symbolic_shapes import mesh_values
from tess_compile.core.fake_run import fake_run, local_bytes
from tess_compile.core.layout import Layout
from tess_compile.core.mesh import AXES, Mesh
from tess_compile.core.meta_keys import ARG_LAYOUTS, LAYOUT, RECOMPUTE_REGION, REPLICATED, ROLE
from tess_compile.ops.collectives import COLLECTIVE_OPS, COMMUNICATING, wait
from tess_compile.ops.context_attention import context_attention
from tess_compile.ops.fetched_product import fetched_product
from tess_compile.ops.grad_bucket import grad_bucket
from tess_compile.ops.ring_attention import ring_attention
from tess_compile.ops.split_norm import split_norm

__all__ = ["STAGE_VIEWS", "redundant_work_text", "render_dot", "render_svg", "render_text", "rewritten_view"]

# Fill colours of layouts in dot output, by order of first appearance.
_PALETTE = (
    "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94",
    "#f7b6d2", "#dbdb8d", "#9edae5", "#e7cb94", "#cedb9c",
)


@dataclass
class _Line:
    """What a dump shows of one node."""

    node: Node
    code: str  # "linear = aten.linear(x, p_weight)"
    comment: str = ""  # shapes, layout, peers, bytes
    layout: str = ""  # the layout's text; the dot colour key
    shape: str = ""  # the shape on the node's outgoing edges
    conversions: dict[Node, str] = field(default_factory=dict)  # argument -> "A -> B"
    collective: str | None = None  # the tess op's name


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _arg(value) -> str:
    """An argument as Python source: nodes by name."""
    if isinstance(value, Node):
        return value.name
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, tuple):
        items = [_arg(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_arg(v) for v in value) + "]"
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


def _target_name(target) -> str:
    # by its own name: broadcast_start, not broadcast
    if target in COLLECTIVE_OPS or target in (wait, fetched_product, split_norm, grad_bucket, context_attention,
                                                ring_attention):
        return f"tess.{getattr(target, '_opname', None) or target.__name__}"
    if isinstance(target, torch._ops.OpOverload):
        return str(target).removesuffix(".default")
    return f"{target.__module__.lstrip('_')}.{target.__name__}"


def _parameter_names(target) -> list[str]:
    if isinstance(target, torch._ops.OpOverload):
        return [a.name for a in target._schema.arguments]
    return list(inspect.signature(target).parameters)


def _call(node: Node) -> str:
    """The right-hand side of a call_function node."""
    if node.target is operator.getitem:
        source, index = node.args
        return f"{_arg(source)}[{_arg(index)}]"
    if node.target in COLLECTIVE_OPS:
        # (x, axis, *rest): the axis reads as along="col", the rest by name.
        names = _parameter_names(node.target)
        x, axis, *rest = node.args
        args = [_arg(x), f"along={_quote(axis)}"] + [f"{n}={_arg(v)}" for n, v in zip(names[2:], rest)]
    elif node.target is fetched_product:  # the used blocks, then what backward keeps and fetches by name
        names = _parameter_names(node.target)
        args = [_arg(a) for a in node.args[:2]] + [f"{n}={_arg(v)}" for n, v in zip(names[2:], node.args[2:])]
    else:
        args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
    return f"{_target_name(node.target)}({', '.join(args)})"


def _code(node: Node) -> str:
    if node.op == "placeholder":
        role, name = ROLE.of(node)
        return f"{node.name} = {role}({_arg(name)})"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    if node.op == "call_function":
        return f"{node.name} = {_call(node)}"
    return f"{node.name} = {node.op}({_arg(node.target)})"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(value, layout=None) -> tuple[list[tuple[torch.Tensor, object]], bool]:
    """(tensor, layout) pairs of a value, and whether it is a tuple of them."""
    many = isinstance(value, (tuple, list))
    values = value if many else (value,)
    layouts = layout if isinstance(layout, tuple) else (layout,) * len(values)
    return [(v, lay) for v, lay in zip(values, layouts) if isinstance(v, torch.Tensor)], many


def _each(value, describe, layout=None) -> str:
    """`describe(tensor, layout)` of each tensor of `value`, a tuple's in parentheses."""
    pairs, many = _tensors(value, layout)
    parts = [describe(v, lay) for v, lay in pairs]
    return "(" + ", ".join(parts) + ")" if many else "".join(parts)


def _layout_text(layout) -> str:
    if isinstance(layout, tuple):
        return "(" + ", ".join(str(p) for p in layout) + ")"
    return str(layout) if isinstance(layout, Layout) else ""


def _replicated_header(gm: GraphModule, values: dict | None = None) -> list[str]:
    """Ops that run replicated (no sharding rule): op, model line, and the bytes
    of the output that every rank computes whole."""
    lines = []
    for node in gm.graph.nodes:
        if not REPLICATED.has(node):
            continue
        val = values[node] if values is not None else node.meta.get("val")
        cost = _each(val, lambda v, _: f"{v.numel() * v.element_size()} bytes")
        lines.append(f"  {_target_name(node.target)} at {REPLICATED.of(node)}: output {cost} on every rank")
    return ["runs replicated (no sharding rule):"] + lines if lines else []


def redundant_work_text(ratio: float | None) -> str:
    if ratio is None:
        return "redundant work: none to measure (the model runs no matmul-like FLOPs)"
    return f"redundant work: {ratio:.2f} (forward FLOPs over all ranks / unsharded)"


def _where(mesh: Mesh, rank: int) -> str:
    k, i, j = mesh.coords(rank)
    return f"rank {rank} at (k, i, j) = ({k}, {i}, {j})"


def _captured_view(gm: GraphModule, mesh: Mesh, rank: int):
    header = ["tess-compile captured graph (ATen, global shapes)"]
    lines = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        comment = _each(val, lambda v, _: f"{list(v.shape)} {_dtype(v.dtype)}")
        lines.append(_Line(node, _code(node), comment, shape=_each(val, lambda v, _: str(list(v.shape)))))
    return header, lines


def _placed_view(gm: GraphModule, mesh: Mesh, rank: int):
    header = [f"tess-compile placed graph, mesh {mesh}, {_where(mesh, rank)}"] + _replicated_header(gm)
    _, lines = _captured_view(gm, mesh, rank)
    for line in lines:
        node, layout = line.node, LAYOUT.get(line.node)
        if layout is not None:
            val = node.meta.get("val")
            local = lambda v, lay: str(lay.local_shape(v.shape, mesh))  # noqa: E731
            line.comment = _each(val, lambda v, lay: f"{list(v.shape)} {_dtype(v.dtype)} {lay} local {local(v, lay)}",
                                 layout)
            line.shape = _each(val, local, layout)
            line.layout = _layout_text(layout)
        for arg, needed in ARG_LAYOUTS.get(node, {}).items():
            have = LAYOUT.get(arg)
            if isinstance(have, Layout) and have != needed:
                line.conversions[arg] = f"{have} -> {needed}"
    return header, lines


def rewritten_view(gm: GraphModule, mesh: Mesh, rank: int, sizes: dict[str, int] | None = None):
    values = fake_run(gm, mesh)
    costs = collective_costs(gm, mesh)
    by_node: dict[Node, list[CollectiveCost]] = {}
    for cost in costs:
        by_node.setdefault(cost.node, []).append(cost)
    lines = []
    for node in gm.graph.nodes:
        layout = LAYOUT.get(node)
        val = values[node] if node.op != "output" else None
        parts = [_layout_text(layout), _each(val, lambda v, _: f"local {list(v.shape)} {_dtype(v.dtype)}")]
        parts += [_collective_text(cost, mesh, rank) for cost in by_node.get(node, [])]
        if RECOMPUTE_REGION.has(node):
            parts.append(f"recomputed in backward ({RECOMPUTE_REGION.of(node)})")
        shape = _each(val, lambda v, _: str(list(v.shape)))
        collective = COLLECTIVE_OPS.get(node.target) if node.op == "call_function" and node in by_node else None
        comment = " ".join(p for p in parts if p)
        lines.append(_Line(node, _code(node), comment, _layout_text(layout), shape, collective=collective))
    header = _rewritten_header(gm, mesh, rank, costs, values)
    if sizes is not None:
        header += _symbolic_header(gm, mesh, sizes, costs)
    return header, lines


def _collective_text(cost: CollectiveCost, mesh: Mesh, rank: int) -> str:
    if cost.backward_of is not None:  # a product's fetch again in backward
        peers = mesh.group(rank, cost.axis)
        return f"backward {cost.backward_op} along {cost.axis} peers {peers} bytes {cost.backward_bytes}"
    text = f"peers {mesh.group(rank, cost.axis)} bytes {cost.forward_bytes or 0}"
    if cost.backward_bytes is not None:
        text += f"; backward {cost.backward_op} bytes {cost.backward_bytes}"
    return text


def _rewritten_header(gm: GraphModule, mesh: Mesh, rank: int, costs, values) -> list[str]:
    peers = ", ".join(f"{axis} {mesh.group(rank, axis)}" for axis in AXES)
    moved = bytes_by_phase(costs)
    totals = {phase: sum(moved[phase].values()) for phase in PHASES}
    header = [
        f"tess-compile rewritten graph, mesh {mesh}, {mesh.num_ranks} ranks",
        f"{_where(mesh, rank)}; peers along {peers}",
        f"parameter bytes on this rank: {_parameter_bytes(gm, mesh)}",
        f"bytes moved by this rank, inputs without grad: forward {totals['forward']}, backward {totals['backward']}",
    ]
    for phase in PHASES:
        for (op, axis), num_bytes in sorted(moved[phase].items()):
            header.append(f"  {phase} {op} along {axis}: {num_bytes}")
    return header + _replicated_header(gm, values)


def _symbolic_header(gm: GraphModule, mesh: Mesh, sizes: dict[str, int], costs: list[CollectiveCost]) -> list[str]:
    values = {**sizes, **mesh_values(mesh)}
    formulas = formulas_by_phase(symbolic_costs(gm, mesh, sizes, costs=costs))
    named = ", ".join(f"{k}={v}" for k, v in values.items())
    return [f"bytes moved as formulas ({named}):"] + [f"  {line}" for line in format_symbolic(formulas, values)]


def _parameter_bytes(gm: GraphModule, mesh: Mesh) -> int:
    return sum(local_bytes(node, mesh) for node in gm.graph.nodes
               if node.op == "placeholder" and ROLE.of(node)[0] == "param")


STAGE_VIEWS = {"captured": _captured_view, "placed": _placed_view, "rewritten": rewritten_view}


def render_text(header: list[str], lines: list[_Line]) -> str:
    out = [f"# {h}" for h in header]
    for line in lines:
        out += [f"# convert {arg.name}: {text}" for arg, text in line.conversions.items()]
        out.append(f"{line.code}  # {line.comment}" if line.comment else line.code)
    return "\n".join(out) + "\n"


def render_dot(stage: str, header: list[str], lines: list[_Line]) -> str:
    colours: dict[str, str] = {}
    for line in lines:
        if line.layout and line.layout not in colours:
            colours[line.layout] = _PALETTE[len(colours) % len(_PALETTE)]
    title = _dot_string("\n".join(header))
    out = [
        f"digraph {stage} {{",
        f'  graph [label={title}, labelloc=t, labeljust=l, fontname="monospace"];',
        '  node [shape=box, style="rounded,filled", fillcolor="#ffffff", fontname="monospace", fontsize=10];',
        '  edge [fontname="monospace", fontsize=9];',
    ]
    shapes = {line.node: line.shape for line in lines}
    for line in lines:
        out.append(f"  {_quote(line.node.name)} [{_dot_node_style(line, colours)}];")
        for arg in line.node.all_input_nodes:
            out.append(f"  {_quote(arg.name)} -> {_quote(line.node.name)} [{_dot_edge_style(line, arg, shapes[arg])}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _dot_node_style(line: _Line, colours: dict[str, str]) -> str:
    label = line.code if not line.comment else f"{line.code}\n{line.comment}"
    style = [f"label={_dot_string(label)}", f'fillcolor="{colours.get(line.layout, "#ffffff")}"']
    if line.collective in COMMUNICATING:
        style += ["shape=octagon", 'style="filled,bold"', 'color="#d62728"', "penwidth=2.5"]
    elif line.collective is not None:
        style += ["shape=octagon", 'style="filled,dashed"', 'color="#7f7f7f"']
    return ", ".join(style)


def _dot_edge_style(line: _Line, arg: Node, shape: str) -> str:
    if arg in line.conversions:
        return f'label={_dot_string(f"{shape} {line.conversions[arg]}")}, color="#d62728", fontcolor="#d62728"'
    return f"label={_dot_string(shape)}"


def _dot_string(text: str) -> str:
    """A quoted dot string, its lines left-justified."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(f"{line}\\l" for line in escaped.split("\n")) + '"'


def render_svg(dot: str) -> str:
    result = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"Graphviz `dot -Tsvg` failed: {result.stderr.strip()}")
    return result.stdout
