"""Stage 1, capture's cleanup: writes through views made functional.

`y[:, 1:] = x[:, :-1]` traces as `copy_(slice(y, 1, 1), ...)`: an in-place op
whose target is a view of another value, after which the graph reads `y`, not
the in-place op's output. The per-rank program cannot keep such aliasing: a
view that needs a layout of its own is a view of a converted copy, and a write
into the copy is lost. So `functionalize_view_mutations` rewrites, as torch's
functionalization does, every in-place op on a value made inside the graph whose
target is a view, or whose target has aliases made before it and read after it:

- the op runs out of place on the view (`fill_` -> `fill`; `copy_` -> the
  source cast and expanded to the view);
- the result is scattered back through the chain of views into the base
  (`slice_scatter`, `select_scatter`, an inverse permute or reshape, ...);
- every later read of the base or of an alias made before the write reads the
  same view of the new base, replayed.

In-place ops on a whole value that nothing else aliases stay as they are, and
so do writes into inputs, parameters and buffers (capture refuses those).
Which value aliases which is read off the capture's fake values before the
rewrite (two values alias when they share a storage). A write through a view
that has no inverse here (`expand`, `unfold`, ...) is a ValueError naming the
op and the model's line.

`may_alias_root(node)` (the value that `node` may be a view of, by the ops'
schemas) serves the capture's dead-code elimination.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from tess_compile.core.meta_keys import RECOMPUTE_REGION
from tess_compile.passes.source_lines import source_line

__all__ = ["functionalize_view_mutations", "may_alias_root", "node_like", "writes_in_place"]

aten = torch.ops.aten

# Multi-output views, whose items (getitem) are views of the input.
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
# Views that only rearrange the elements of their input: written back by a reshape to the input's shape.
_RESHAPES = (
    aten.view.default, aten.reshape.default, aten._reshape_alias.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints, aten.unflatten.int,
    aten.view_as.default, aten.reshape_as.default,
)
# The meta keys a rewritten node takes from the in-place op it replaces (source lines, checkpoint regions).
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "custom", "from_node", "seq_nr",
              RECOMPUTE_REGION.name)


def writes_in_place(node: Node) -> bool:
    """Whether `node` is an op that writes its first argument in place (`add_`, `copy_`, `index_put_`)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    arguments = node.target._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _input(node: Node) -> Node | None:
    """The input a view or in-place op's output may alias: its first argument, or a split's for an item."""
    source = node.args[0] if node.op == "call_function" and node.args else None
    if node.target is operator.getitem and isinstance(source, Node) and source.target in _SPLITS:
        source = source.args[0]
    return source if isinstance(source, Node) else None


def may_alias_root(node: Node) -> Node:
    """The value `node` may be a view of, through ops whose schema says their output may alias their
    first argument (views, `reshape`, in-place ops, a split's items); `node` itself if none."""
    while (source := _input(node)) is not None:
        op = node.args[0].target if node.target is operator.getitem else node.target
        returns = op._schema.returns if isinstance(op, torch._ops.OpOverload) else ()
        if not returns or returns[0].alias_info is None:
            break
        node = source
    return node


def functionalize_view_mutations(gm: GraphModule) -> None:
    """Rewrite the in-place ops described in the module docstring, in graph order."""
    _Functionalizer(gm).run()


class _Functionalizer:
    """The rewrite of one graph. `sources` maps each value that aliases its input (a view, an in-place
    op's output) to that input; it is read off the fake values once and kept up to date."""

    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.sources = {node: _input(node) for node in gm.graph.nodes if _shares_input_storage(node)}

    def run(self) -> None:
        for write in [node for node in self.gm.graph.nodes if writes_in_place(node)]:
            self.order = {node: index for index, node in enumerate(self.gm.graph.nodes)}
            root = self.root(write.args[0])
            if root.op != "call_function":  # an input, parameter or buffer: capture refuses writes into those
                continue
            aliases = self.aliases_before(root, write)
            if self.through_a_view(write.args[0], root) or any(self.read_after(a, write) for a in aliases):
                self.rewrite(write, root, aliases)
        self.gm.graph.lint()
        self.gm.recompile()

    def root(self, node: Node) -> Node:
        while node in self.sources:
            node = self.sources[node]
        return node

    def aliases_before(self, root: Node, write: Node) -> list[Node]:
        """`root` and the values made from it by views and in-place ops before `write`, sources first."""
        found, todo = [root], [root]
        while todo:
            for user in todo.pop(0).users:
                if self.order[user] < self.order[write] and user not in found and self.sources.get(user) in found:
                    found.append(user)
                    todo.append(user)
        return found

    def through_a_view(self, target: Node, root: Node) -> bool:
        """Whether a view lies between `root` and `target` (not only in-place ops)."""
        while target is not root:
            if not writes_in_place(target):
                return True
            target = self.sources[target]
        return False

    def read_after(self, alias: Node, write: Node) -> bool:
        return any(self.order[user] > self.order[write] for user in alias.users)

    def rewrite(self, write: Node, root: Node, aliases: list[Node]) -> None:
        """The out-of-place op, its scatters back into `root`, and every later read of an alias replayed."""
        target = write.args[0]
        with self.gm.graph.inserting_before(write):
            value = _out_of_place(write)
            view = target
            while view is not root:
                base = self.sources[view]
                value = value if writes_in_place(view) else _scatter(write, view, base, value)
                view = base
        replayed = {root: value}
        with self.gm.graph.inserting_before(write.next):
            for alias in aliases[1:]:
                replayed[alias] = self.replay(write, alias, replayed)
        replayed[write] = replayed[target]
        for alias, new in replayed.items():
            for user in [user for user in alias.users if self.order.get(user, -1) > self.order[write]]:
                user.replace_input_with(alias, new)
                if self.sources.get(user) is alias:
                    self.sources[user] = new
        self.sources.pop(write, None)
        self.gm.graph.erase_node(write)

    def replay(self, write: Node, alias: Node, replayed: dict[Node, Node]) -> Node:
        """`alias` made again from the replayed value of its source (an in-place op's: that value)."""
        source = replayed[self.sources[alias]]
        if writes_in_place(alias):
            return source
        if alias.target is operator.getitem:
            split = alias.args[0]
            items = node_like(write, split.target, (source, *split.args[1:]), dict(split.kwargs))
            made = node_like(write, operator.getitem, (items, alias.args[1]), {})
        else:
            made = node_like(write, alias.target, (source, *alias.args[1:]), dict(alias.kwargs))
        self.sources[made] = source
        return made


def _shares_input_storage(node: Node) -> bool:
    source = _input(node)
    val = node.meta.get("val")
    other = source.meta.get("val") if source is not None else None
    return (isinstance(val, torch.Tensor) and isinstance(other, torch.Tensor)
            and StorageWeakRef(val.untyped_storage()) == StorageWeakRef(other.untyped_storage()))


def _out_of_place(write: Node) -> Node:
    """The value the in-place op `write` gives its target, computed out of place."""
    target, op = write.args[0], write.target
    if op is aten.copy_.default:  # the source, cast and broadcast to the target
        view, source = target.meta["val"], write.args[1]
        if source.meta["val"].dtype != view.dtype:
            source = node_like(write, aten._to_copy.default, (source,), {"dtype": view.dtype})
        if source.meta["val"].shape != view.shape:
            source = node_like(write, aten.expand.default, (source, list(view.shape)), {})
        return source
    name = op._schema.name.split("::")[-1]
    packet = getattr(aten, name.removesuffix("_"), None) if name.endswith("_") else None
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None:
        raise ValueError(f"{op} at {source_line(write)} writes into a view of another value and has no out-of-place "
                         "form: compute the new value out of place and use it instead")
    return node_like(write, twin, (target, *write.args[1:]), dict(write.kwargs))


def _scatter(write: Node, view: Node, base: Node, value: Node) -> Node:
    """`base` with the elements that `view` shows replaced by `value`."""
    op, args = view.target, view.args
    if op is operator.getitem:
        return _scatter_item(write, args[0], args[1], base, value)
    shape = list(base.meta["val"].shape)
    if op is aten.slice.Tensor:
        return node_like(write, aten.slice_scatter.default, (base, value, *args[1:]), dict(view.kwargs))
    if op is aten.narrow.default:
        dim, start, length = args[1:4]
        return node_like(write, aten.slice_scatter.default, (base, value, dim, start, start + length), {})
    if op is aten.select.int:
        return node_like(write, aten.select_scatter.default, (base, value, *args[1:]), {})
    if op is aten.diagonal.default:
        return node_like(write, aten.diagonal_scatter.default, (base, value, *args[1:]), dict(view.kwargs))
    if op is aten.as_strided.default:
        return node_like(write, aten.as_strided_scatter.default, (base, value, *args[1:]), dict(view.kwargs))
    if op is aten.permute.default:
        order = [dim % len(shape) for dim in args[1]]
        return node_like(write, aten.permute.default, (value, sorted(range(len(shape)), key=order.__getitem__)), {})
    if op in (aten.transpose.int, aten.t.default):
        return node_like(write, op, (value, *args[1:]), {})
    if op in (aten.alias.default, aten.detach.default, aten.contiguous.default):
        return value
    if op in _RESHAPES:
        return node_like(write, aten.reshape.default, (value, shape), {})
    raise ValueError(f"{write.target} at {source_line(write)} writes through a view made by {op} ({view.name}), "
                     "which tess-compile cannot write back into its base: compute the new value out of place "
                     "(torch.where, torch.cat, Tensor.slice_scatter) and use it instead")


def _scatter_item(write: Node, split: Node, index: int, base: Node, value: Node) -> Node:
    """`base` with item `index` of a split, chunk or unbind of it replaced by `value`."""
    if split.target is aten.unbind.int:
        dim = split.args[1] if len(split.args) > 1 else split.kwargs.get("dim", 0)
        return node_like(write, aten.select_scatter.default, (base, value, dim, index), {})
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    sizes = [item.shape[dim] for item in split.meta["val"]]
    start = sum(sizes[:index])
    return node_like(write, aten.slice_scatter.default, (base, value, dim, start, start + sizes[index]), {})


def node_like(write: Node, target, args: tuple, kwargs: dict) -> Node:
    """A new node `target(*args, **kwargs)`, at the graph's insertion point, with its fake value and
    the source meta of `write` (its lines, its checkpoint region)."""
    node = write.graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    node.meta["val"] = target(*fake_args, **fake_kwargs)
    node.meta.update({key: write.meta[key] for key in _KEPT_META if key in write.meta})
    return node
