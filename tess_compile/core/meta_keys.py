"""The typed contract between the passes: every key that tess-compile writes into `node.meta`
and `gm.meta`, with its type, what it means, which pass writes it and which code reads it.

The passes hand each other their results in `meta`, as torch's own passes do (`ShapeProp`
writes `tensor_meta`); the runtimes and analyses read what the passes left. Each key is one
`MetaKey` constant here, and all code reads and writes it through the constant:

    LAYOUT.set(node, layout)              # write
    layout = LAYOUT.of(node)              # read a key that must be there (KeyError if not)
    layout = LAYOUT.get(node)             # read a key that may be missing (None, or a default)
    if REPLICATED.has(node): ...          # test for it

A holder is a node, a graph module (the `gm.meta` keys: `IN_SPEC`, ..., `SCHEDULE_COUNTS`) or a
`meta` dict itself. Torch's own keys (`TORCH_KEYS`: `val`, `stack_trace`, ...) are torch's
contract, read as torch writes them. This module imports nothing of tess_compile but the core's
layouts, so the passes, the runtimes and the analyses all may import it.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

from tess_compile.core.layout import Layout

__all__ = [
    "ALIAS_OF",
    "AUTOCAST_REGION",
    "ARG_LAYOUTS",
    "BLOCK_REPEATS",
    "CARRIED",
    "CARRIED_OUTPUTS",
    "CAUSAL_BOUNDED",
    "CONSTANT_VALUE",
    "DTYPE",
    "GLOBAL_NODE",
    "GLOBAL_SHAPE",
    "GUARDS",
    "INDEX_CHECK",
    "IN_SPEC",
    "KEYS",
    "LAYOUT",
    "LOCAL_INPUT",
    "LOCAL_OUTPUTS",
    "OUT_SPEC",
    "PRODUCT_SCHEDULES",
    "RECOMPUTE_REGION",
    "REPLICATED",
    "ROLE",
    "SCHEDULE_COUNTS",
    "STATE_KEYS",
    "SUMMA_STEP",
    "TENSORS",
    "TORCH_KEYS",
    "WEIGHT_INPUT",
    "MetaKey",
]

T = TypeVar("T")

# Keys that torch writes (export, Dynamo, FX's passes, AOTAutograd) and our code reads or hands on
# as they are; not ours, so not defined here. AOTAutograd reads a `CheckpointPolicy` under the name
# "recompute", beside "ac_graph_id" (`tess_compile.runtime.inductor` swaps ours for it).
TORCH_KEYS = (
    "val", "example_value", "tensor_meta", "stack_trace", "nn_module_stack", "source_fn_stack", "custom",
    "from_node", "seq_nr", "grapharg", "ac_graph_id",
)


def _meta(holder) -> dict[str, Any]:
    """The `meta` dict of a node or graph module, or `holder` itself if it is one."""
    return holder if isinstance(holder, dict) else holder.meta


class MetaKey(Generic[T]):
    """One key of `meta` and the type of its value; the instance's docstring says what it
    means, who writes it and who reads it. `holder`: a node, a graph module or a meta dict."""

    def __init__(self, name: str, doc: str):
        self.name = name
        self.__doc__ = doc

    def __repr__(self) -> str:
        return f"MetaKey({self.name!r})"

    def get(self, holder, default: T | None = None) -> T | None:
        """The value, or `default` where the key is missing."""
        return _meta(holder).get(self.name, default)

    def of(self, holder) -> T:
        """The value of a key that must be there (a KeyError naming the key if it is not)."""
        return _meta(holder)[self.name]

    def set(self, holder, value: T) -> None:
        _meta(holder)[self.name] = value

    def setdefault(self, holder, value: T) -> T:
        """The value; `value`, stored first, where the key is missing."""
        return _meta(holder).setdefault(self.name, value)

    def has(self, holder) -> bool:
        return self.name in _meta(holder)

    def pop(self, holder, default: T | None = None) -> T | None:
        """Remove the key; its value, or `default` where it was missing."""
        return _meta(holder).pop(self.name, default)


# --- placeholders of the captured graph, and of the per-rank graph (the rewrite copies them) ---

ROLE: MetaKey[tuple[str, str | int]] = MetaKey("role", """On every placeholder: what it holds,
`("param", fqn)`, `("buffer", fqn)` (persistent), `("constant", name)` (tensor constants and
non-persistent buffers), `("alias", fqn)` (a tied weight's second name) or `("input", index)` (flat
user input). Written by capture; the rewrite copies it onto the per-rank placeholders. Read by place,
rewrite, the driver (`Slot`s), merge_products, bucket_gradients, the rules (`is_param`,
`display_name`, products, index_checks), `core.fake_run` and the analyses.""")

WEIGHT_INPUT: MetaKey[str] = MetaKey("weight_input", """On a user input that is a weight (Dynamo's
graphs take parameters as inputs): the weight's name. Written by capture (`weight_inputs=`); the
rewrite copies it. Read by place (free like a parameter), the driver (a "weight" `Slot`),
merge_products, the rules' `display_name`, `core.fake_run.requires_grad` and `analysis.memory`.""")

ALIAS_OF: MetaKey[str] = MetaKey("alias_of", """On a tied weight's second placeholder (role "alias"):
the name of the tensor it ties to. Written by capture, copied by rewrite onto the per-rank placeholder;
read by place (the tensor's layout), the driver (`Slot.alias_of`) and `core.fake_run.placeholder_values`
(the tied tensor's value).""")

LOCAL_INPUT: MetaKey[bool] = MetaKey("local_input", """On a user input that arrives as this rank's
block in its layout, not whole (a pipeline stage's positional inputs, a carried input). Written by the
boundary pass; the rewrite copies it. Read by the rewrite (no slicing), the driver (a "local input"
`Slot`) and the rules' index checks (no global check of a block).""")

CARRIED: MetaKey[bool] = MetaKey("carried", """On the placeholder of an input that a caller feeds back
from an output (a KV cache): its layout is the one its output is computed in. Written by the boundary
pass; read by place.""")

CONSTANT_VALUE: MetaKey[object] = MetaKey("constant_value", """On a per-rank placeholder of an input
that is no tensor (a flag or number): the value the program was compiled for. Written by the rewrite;
read by `core.fake_run` and `core.program.Program` (the call's check).""")

DTYPE: MetaKey[torch.dtype] = MetaKey("dtype", """On a per-rank tensor placeholder: its dtype. Written
by the rewrite; read by merge_products, `core.fake_run` and the analyses (symbolic, accounting).""")

# --- the output node ---

LOCAL_OUTPUTS: MetaKey[bool] = MetaKey("local_outputs", """On the output node: the outputs leave as
this rank's blocks in the home layout of their shape (a pipeline stage's). Written by the boundary
pass; read by place and the rewrite (no `seed_once`).""")

CARRIED_OUTPUTS: MetaKey[dict[int, Node]] = MetaKey("carried_outputs", """On the output node:
`{flat output index: placeholder of the input it is fed back to}`; such an output leaves as this
rank's block in the layout it is computed in. Written by the boundary pass; read by place and the
rewrite.""")

# --- layouts: the placed graph (every node) and the per-rank graph (the nodes holding its values) ---

LAYOUT: MetaKey[Layout | tuple[Layout | None, ...] | None] = MetaKey("layout", """The layout of the
node's value (a tuple for an op that returns several tensors; None for a value that is no tensor).
Written by place on every node of the placed graph, and by the rewrite on each per-rank node that holds
a captured value. Read by the rewrite, the verifier, the driver, the lowering rules, merge_products,
repeated_work, `core.fake_run` and the analyses (dumps, symbolic, accounting).""")

ARG_LAYOUTS: MetaKey[dict[Node, Layout]] = MetaKey("arg_layouts", """On every op of the placed graph
(the output node too): `{input node: the layout the op needs it in}`; the rewrite converts each input's
`LAYOUT` into it. Written by place; read by the rewrite, the verifier, the driver (output layouts),
the lowering rules and the placed dump.""")

CAUSAL_BOUNDED: MetaKey[bool] = MetaKey("causal_bounded", """On a captured scaled_dot_product_attention
whose mask reads an input (a padding mask) but is the causal mask AND something else: no query attends a
key after it. Written by capture (`passes.causal_masks`); read by `passes.causal_masks.is_causal` (the
attention rules and the token order: context attention skips the keys in a query's future and balances
its work over a striped token order as under `is_causal`).""")

REPLICATED: MetaKey[str] = MetaKey("replicated", """On an op with no sharding rule, which runs whole on
every rank: the op's line of model code (`source_line`). Written by place; the rewrite copies it onto
the per-rank node holding the op's value. Read by the verifier, repeated_work, `validation.check`'s
report and the dumps.""")

GLOBAL_SHAPE: MetaKey[tuple[int, ...]] = MetaKey("global_shape", """On a per-rank node that holds a
captured value (and every tensor placeholder): that value's global shape; with `LAYOUT` it gives the
local shape. Written by the rewrite; read by the verifier, merge_products, `core.fake_run` and the
analyses (symbolic, symbolic_shapes, accounting).""")

GLOBAL_NODE: MetaKey[str] = MetaKey("global_node", """On every per-rank node made for a captured node:
that node's name ("gradient bucket" for a bucket of gradient all-reduces; the names of all, joined,
for merged products). Written by the rewrite, bucket_gradients and merge_products; read by the
verifier (whose rule to blame), repeated_work, merge_products and `validation`.""")

# --- regions and steps ---

RECOMPUTE_REGION: MetaKey[str] = MetaKey("recompute", """The recompute region a node belongs to, by
name: "checkpoint N" (the model's own `torch.utils.checkpoint` call, written by capture), "block <path>"
(recompute_blocks), "selective N" (recompute_selective); the rewrite copies it onto every node made
for such a node and merge_products onto its merged nodes. Read by the rewrite, merge_products,
recompute_selective, `ops.recompute_region` (which outlines each region), `runtime.inductor` (which
replaces it with AOTAutograd's own policy of the same key name) and the rewritten dump.""")

AUTOCAST_REGION: MetaKey[tuple[str, torch.dtype, bool]] = MetaKey("autocast_region", """On the ops of a
region of forward under its own `torch.autocast(device_type, dtype, enabled)`: those three. Written by
capture (which inlines the region); read by `passes.autocast_casts`, which casts the region's ops by its
state rather than the program's.""")

SUMMA_STEP: MetaKey[int] = MetaKey("summa_step", """On the collectives and products of step t of a
SUMMA loop: t. Written by `passes.summa`; read by recompute_selective (a product's steps are saved),
merge_products (the concatenated weights, read by every step, take none) and `analysis.symbolic`
(step 0 counts q times).""")

INDEX_CHECK: MetaKey[bool] = MetaKey("index_check", """On the per-rank nodes of a global check of
lookup ids or targets, emitted after the placeholders. Written and read by the rules' index checks
(`passes.rules.index_checks`: later checks go after the earlier ones).""")

# --- the graph module's meta (gm.meta) ---

IN_SPEC: MetaKey[pytree.TreeSpec] = MetaKey("in_spec", """gm.meta: the pytree spec of the model's
inputs `(args, kwargs)`. Written by capture (the rewrite hands the graph's meta on); read by the
boundary pass and the driver (`Program.in_spec`).""")

OUT_SPEC: MetaKey[pytree.TreeSpec] = MetaKey("out_spec", """gm.meta: the pytree spec of the model's
outputs. Written by capture; read by the driver (`Program.out_spec`).""")

TENSORS: MetaKey[dict[str, torch.Tensor]] = MetaKey("tensors", """gm.meta: the model's lifted tensors
(parameters, buffers, constants) by name. Written by capture; read by the driver (`Program.tensors`).""")

STATE_KEYS: MetaKey[list[str]] = MetaKey("state_keys", """gm.meta: the model's state-dict keys, in its
order. Written by capture; read by the driver (`Program.state_keys`).""")

GUARDS: MetaKey[int] = MetaKey("guards", """gm.meta of a dynamic compile's capture: the number of
guards the capture left in the shape environment, so that the driver tells the conditions the later
passes assumed. Written by capture; read by the driver.""")

SCHEDULE_COUNTS: MetaKey[dict[str, int]] = MetaKey("schedules", """gm.meta of the per-rank graph: how many
matrix products run each SUMMA schedule. Written by the rewrite; read by the driver (its log line) and
`Program.schedules`.""")

BLOCK_REPEATS: MetaKey[dict[str, int]] = MetaKey("block_repeats", """gm.meta of a graph shortened to four of
its repeated blocks (block reuse): `{captured node name: how many blocks of the whole graph it stands for}`
for the ops and placeholders of block 2, which stands for blocks 2 .. N-2. Written by
`passes.repeated_blocks.shorten`; the rewrite hands it on. Read through `repeated_blocks.repeats_of` by
alike_regions and repeated_work, which count block 2's nodes that many times.""")

PRODUCT_SCHEDULES: MetaKey[dict[str, dict[str, int]]] = MetaKey("product_schedules", """gm.meta of the
per-rank graph: `{captured node name: {schedule: products}}` for the captured ops lowered to matrix products
(`SCHEDULE_COUNTS` per op). Written by the rewrite; read by `passes.expand_blocks` (the schedule counts of
the copied blocks).""")

# Every key of the contract, by its name in `meta`.
KEYS: dict[str, MetaKey] = {key.name: key for key in (
    ROLE, WEIGHT_INPUT, ALIAS_OF, LOCAL_INPUT, CARRIED, CONSTANT_VALUE, DTYPE, LOCAL_OUTPUTS, CARRIED_OUTPUTS,
    LAYOUT, ARG_LAYOUTS, CAUSAL_BOUNDED, REPLICATED, GLOBAL_SHAPE, GLOBAL_NODE, RECOMPUTE_REGION, AUTOCAST_REGION, SUMMA_STEP,
    INDEX_CHECK,
    IN_SPEC, OUT_SPEC, TENSORS, STATE_KEYS, GUARDS, SCHEDULE_COUNTS, BLOCK_REPEATS, PRODUCT_SCHEDULES,
)}
