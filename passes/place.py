"""Stage 2, place: decide a layout for every value (an analysis; edits nothing else).

Reads torch's `meta["val"]` (global fake tensors from capture) and, of
`tess_compile.core.meta_keys`, `ROLE`, `WEIGHT_INPUT`, `ALIAS_OF` and `CARRIED` on the
placeholders and, on the output node, `LOCAL_OUTPUTS` and `CARRIED_OUTPUTS` (outputs fed back
as inputs: each such input takes the layout its output is computed in, found in one more round).
Writes `LAYOUT` (the value's layout, a tuple for ops that return several tensors) and
`ARG_LAYOUTS` (`{input node: layout the op needs it in}`) on every node; the rewrite inserts
the collectives that convert one into the other. Ops that run replicated get `REPLICATED`
(the op's own line of model code, `source_line`).

User inputs start in their home layout (batch split over depth and row,
or tokens over the axes the batch leaves, `tess_compile.core.row_split`; last dim over col;
whole in mode "1d" but for its token split), and outputs of a pipeline stage
(`LOCAL_OUTPUTS`) leave in the home layout of their shape, so that one stage's output blocks
are the next stage's input blocks. Parameters, buffers, constants and weights that arrive
as inputs (`WEIGHT_INPUT`) are free until their first consumer
fixes their layout. Ops are looked up in the rule table of the mesh's mode
(`tess_compile.passes.rules.placement_rules`); a rule that needs another family's rule asks the
context for it (`PlacementContext.rule`), never the other family's file;
an op with no rule runs replicated (`strict=True`: a ValueError); the
compile's one summary lists them (`tess_compile.passes.repeated_work`). A decision that
gives an op a padded block it cannot take (an uneven split) is a ValueError
(`tess_compile.passes.rules.uneven`).

A rule may ask for a producer's output to be laid out with groups (a fused
QKV projection feeding `split`: a `groupable` product of
`tess_compile.core.product_table`); the pass then runs once more with that hint.
A permutation of a free tensor (`x @ W.T`), or autocast's cast of one, is
free as well: its first consumer fixes its layout, and the tensor's is that
layout permuted back.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from tess_compile.passes.rules import family_of, placement_rule, placement_rules
from tess_compile.passes.rules.common import partials_to_tokens, place_replicated
from tess_compile.passes.rules.family import Decision
from tess_compile.passes.rules.uneven import check_uneven
from tess_compile.passes.source_lines import source_line
from tess_compile.core.layout import Layout, Partial, Replicate, Shard
from tess_compile.core.mesh import Mesh
from tess_compile.core.row_split import RowSplit, token_dim
from tess_compile.core.product_table import product_kernel
from tess_compile.core.meta_keys import (
    ALIAS_OF,
    ARG_LAYOUTS,
    CARRIED,
    CARRIED_OUTPUTS,
    LAYOUT,
    LOCAL_OUTPUTS,
    RECOMPUTE_REGION,
    REPLICATED,
    ROLE,
    WEIGHT_INPUT,
)

__all__ = ["PlacementContext", "home_layout", "place"]

_MAX_ROUNDS = 4
_KEEP_LAST_DIM = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _last_dim(node: Node) -> int:
    return node.meta["val"].shape[-1]


class PlacementContext:
    """What a placement rule may ask: layouts, shapes, the mesh, hints, other families' rules."""

    def __init__(self, mesh: Mesh, hints: dict[Node, int], carried: dict[Node, Layout] | None = None,
                 rows: RowSplit = RowSplit()):
        self.mesh = mesh
        self.rows = rows  # how the inputs' rows split (`home_layout`)
        self.hints = hints
        self.carried = carried if carried is not None else {}  # a carried input -> its layout
        self.layouts: dict[Node, object] = {}
        self.free_permutations: dict[Node, tuple[Node, list[int]]] = {}
        self.rerun = False

    def layout(self, node: Node) -> Layout | None:
        """The layout of `node`, or None while a parameter/buffer is still free."""
        return self.layouts.get(node)

    @staticmethod
    def shape(node: Node) -> tuple[int, ...]:
        return tuple(node.meta["val"].shape)

    def rule(self, op, families: tuple[str, ...]):
        """The placement rule of `op` in the mesh's mode if a family of `families` holds it, else
        None: how one family's rule asks another's, through the table, not the other's file."""
        return placement_rule(self.mesh.mode, op, families)

    def permute_free(self, node: Node, source: Node, order: list[int]) -> Decision:
        """`node` permutes the free tensor `source` by `order` (autocast's cast: in order): both stay
        free (see `fix`)."""
        self.free_permutations[node] = (source, order)
        return Decision({}, None)

    def fix(self, node: Node, layout: Layout) -> None:
        """A free tensor takes its first consumer's layout; a free permutation gives its
        source that layout permuted back, if the source is still free."""
        self.layouts[node] = layout
        if node in self.free_permutations:
            source, order = self.free_permutations[node]
            if self.layouts.get(source) is None:
                self.fix(source, _permuted_back(layout, order))

    def want_groups(self, node: Node, groups: int) -> bool:
        """Ask `node`'s producer for `groups` on its last dim; True if a rerun will give it.

        Reshapes that keep the last dim (GPT-2's `addmm(...).view(b, s, 3h)`) pass
        the request on to their input.
        """
        while node.target in _KEEP_LAST_DIM and _last_dim(node.args[0]) == _last_dim(node):
            node = node.args[0]
        kernel = product_kernel(node.target)  # a product whose output may take groups on its last dim for free
        if kernel is None or not kernel.groupable or self.hints.get(node) == groups:
            return False
        self.hints[node] = groups
        self.rerun = True
        return True


def home_layout(node: Node, mesh: Mesh, rows: RowSplit = RowSplit()) -> Layout | None:
    """A user input's layout: its rows split as `rows` says (`tess_compile.core.row_split`: by default the
    batch over depth and row), the features of a float `[b, h]` or `[b, s, h]` over col; in mode "1d"
    whole, or with the tokens over col (sequence parallelism).

    A batch that d*q does not divide may stay whole over row ("depth") or over both ("none"), for a
    batch of one or a decode step: products then keep their weights still and move these few rows
    (`tess_compile.passes.rules.products`); the tokens of each sequence may take the axes the batch
    leaves whole.
    """
    val = node.meta["val"]
    if not isinstance(val, torch.Tensor):
        return None  # a flag or number: no layout
    if val.dim() == 0:
        return Layout.replicated()
    tokens = token_dim(val, rows.length)

    def rows_on(axis: str):
        if axis in rows.batch_axes():
            return Shard(0)
        return Shard(tokens, rows.stripes) if tokens is not None and axis in rows.token_axes() else Replicate()

    if mesh.mode == "1d":
        return Layout(Replicate(), Replicate(), rows_on("col"))
    # [b, h] and [b, s, h] split their features; images and other inputs do not.
    features_split = val.is_floating_point() and val.dim() in (2, 3) and val.shape[-1] % mesh.q == 0
    col = Shard(val.dim() - 1) if features_split else Replicate()
    return Layout(rows_on("depth"), rows_on("row"), col)


def place(gm: GraphModule, mesh: Mesh, *, strict: bool = False, replicate_outputs: bool = False,
          rows: RowSplit = RowSplit(), state_layouts: dict[str, Layout] | None = None) -> GraphModule:
    """Annotate every node of `gm` with its layout; see the module docstring.

    `replicate_outputs`: every output leaves whole on every rank (for callers
    that go on with plain tensors, as Dynamo's do). `rows`: how the
    inputs' batch and tokens split (`home_layout`). `state_layouts`: parameters and
    buffers (by name) whose layouts are fixed already, not free.
    """
    hints: dict[Node, int] = {}
    carried: dict[Node, Layout] = {}
    for _ in range(_MAX_ROUNDS):
        ctx = PlacementContext(mesh, hints, carried, rows)
        ctx.layouts.update(_fixed_state(gm, state_layouts or {}))
        decisions = {node: _decide(node, ctx, strict, replicate_outputs) for node in gm.graph.nodes}
        if not ctx.rerun and not _carry_layouts(gm, ctx, carried):
            break
    by_name = {ROLE.of(n)[1]: n for n in decisions if n.op == "placeholder"}
    for node, decision in decisions.items():
        ARG_LAYOUTS.set(node, decision.args)
        layout = ctx.layouts.get(node) or decision.out
        if ALIAS_OF.has(node):  # a tied weight's second name: the tensor's layout
            layout = ctx.layouts.get(by_name[ALIAS_OF.of(node)])
        if layout is None and node.op == "placeholder" and isinstance(node.meta["val"], torch.Tensor):
            layout = Layout.replicated()  # an unused parameter or buffer
        if node in ctx.free_permutations:  # the source, converted to this layout permuted back
            source, order = ctx.free_permutations[node]
            layout = layout or Layout.replicated()
            ARG_LAYOUTS.set(node, {source: _permuted_back(layout, order)})
        LAYOUT.set(node, layout)
    return gm


def _fixed_state(gm: GraphModule, state_layouts: dict[str, Layout]) -> dict[Node, Layout]:
    """The placeholders of the parameters and buffers named in `state_layouts`, with their layouts."""
    return {node: state_layouts[ROLE.of(node)[1]] for node in gm.graph.find_nodes(op="placeholder")
            if ROLE.of(node)[0] in ("param", "buffer") and ROLE.of(node)[1] in state_layouts}


def _carry_layouts(gm: GraphModule, ctx: PlacementContext, carried: dict[Node, Layout]) -> bool:
    """Give each carried input (`CARRIED_OUTPUTS` of the output node) the layout its output was
    computed in, without partial sums or groups, so that a step's output block is the next step's
    input block as it is; True if any changed (the pass then runs again)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(output.args[0])
    changed = False
    for index, source in CARRIED_OUTPUTS.get(output, {}).items():
        computed = ctx.layouts.get(leaves[index]) or Layout.replicated()
        layout = Layout(*(_plain(p) for p in computed.placements))
        if carried.get(source) != layout:
            carried[source], changed = layout, True
    return changed


def _permuted_back(layout: Layout, order: list[int]) -> Layout:
    """The layout of x, given that of x.permute(order)."""
    return Layout(*(Shard(order[p.dim], p.groups) if isinstance(p, Shard) else p for p in layout.placements))


def _decide(node: Node, ctx: PlacementContext, strict: bool, replicate_outputs: bool) -> Decision:
    if node.op == "placeholder":
        role = ROLE.of(node)[0]
        if CARRIED.has(node):  # free in the first round, then its output's layout (`_carry_layouts`)
            ctx.layouts[node] = ctx.carried.get(node)
        elif role == "input" and not WEIGHT_INPUT.has(node):
            ctx.layouts[node] = home_layout(node, ctx.mesh, ctx.rows)
        return Decision({}, ctx.layouts.get(node))
    if node.op == "output":
        return _decide_outputs(node, ctx, replicate_outputs)
    if node.op != "call_function":
        return Decision({}, Layout.replicated())
    if node.target is operator.getitem:
        source, index = node.args
        decision = Decision({}, ctx.layouts[source][index])
    else:
        rule = placement_rules(ctx.mesh.mode).get(node.target)
        if rule is None:
            REPLICATED.set(node, source_line(node))
            if strict:
                raise ValueError(
                    f"op {node.target} at {REPLICATED.of(node)} has no sharding rule, so it would run "
                    "replicated; strict=True forbids this: add a rule or pass strict=False"
                )
            rule = place_replicated
        decision = _entered(node, ctx, rule)
    check_uneven(node, decision, family_of(node.target), ctx)
    for arg, layout in decision.args.items():
        if ctx.layouts.get(arg) is None:
            ctx.fix(arg, layout)
    ctx.layouts[node] = decision.out
    return decision


def _entered(node: Node, ctx: PlacementContext, rule) -> Decision:
    """`rule`'s decision for `node`, where the partial sums over the tokens of some of its args are
    reduce-scattered to their token blocks first (`_region_entry`), as Megatron-LM's sequence
    parallelism does:

    - a value that enters `node`'s recompute region from outside it: the region saves the value's
      token block for backward, not the whole pending sum (Megatron-LM with full recompute saves
      each layer's `[s/p, b, h]` input);
    - a value that several ops read (the residual stream, which a norm and the next residual add
      read): resolved once, where each reader would otherwise resolve it again or carry the whole
      pending sum on (the adds of every block on `[b, s, h]` sums, and each norm reduce-scattering
      its own float32 cast of them)."""
    region = RECOMPUTE_REGION.get(node)
    entries = {
        arg: _region_entry(ctx, arg) for arg in node.all_input_nodes
        if isinstance(ctx.layouts.get(arg), Layout)
        and (len(arg.users) > 1 or (region is not None and RECOMPUTE_REGION.get(arg) != region))}
    entries = {arg: layout for arg, layout in entries.items() if layout != ctx.layouts[arg]}
    if not entries:
        return rule(node, ctx)
    held = {arg: ctx.layouts[arg] for arg in entries}
    ctx.layouts.update(entries)
    try:
        decision = rule(node, ctx)
    finally:
        ctx.layouts.update(held)
    return Decision({**entries, **decision.args}, decision.out)  # an arg the rule takes as it is: as entered


def _region_entry(ctx: PlacementContext, arg: Node) -> Layout:
    """`arg`'s layout with its partial sums over an axis that splits the tokens resolved to the token split
    where `arg` has the tokens (`partials_to_tokens`: a reduce-scatter); other partial sums stay."""
    layout = ctx.layouts[arg]
    if not any(isinstance(layout.on(axis), Partial) for axis in ctx.rows.token_axes()):
        return layout
    return partials_to_tokens(ctx, arg)


def _decide_outputs(node: Node, ctx: PlacementContext, replicate: bool) -> Decision:
    """Outputs leave as DTensor-expressible layouts (no partials, no groups), or whole;
    with `LOCAL_OUTPUTS` (a pipeline stage's), in the home layout of their shape;
    a carried output (`CARRIED_OUTPUTS`) in the layout of the input it is fed back to
    (its own, once `_carry_layouts` has run)."""
    args = {}
    for out in node.all_input_nodes:
        layout = ctx.layouts.get(out) or Layout.replicated()
        if LOCAL_OUTPUTS.has(node):
            layout = home_layout(out, ctx.mesh, ctx.rows) or Layout.replicated()
        args[out] = Layout.replicated() if replicate else Layout(*(_plain(p) for p in layout.placements))
    leaves = pytree.tree_leaves(node.args[0])
    for index, source in CARRIED_OUTPUTS.get(node, {}).items():
        args[leaves[index]] = ctx.layouts.get(source) or Layout.replicated()
    return Decision(args, None)


def _plain(placement):
    """Partial sums become replicated; grouped splits (a striped token order's too) become plain splits."""
    return Shard(placement.dim) if isinstance(placement, Shard) else Replicate()
