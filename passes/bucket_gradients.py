"""Stage 3b, gradient buckets: the replicated parameters' gradient all-reduces, bucketed.

The rewrite passes each parameter replicated over some mesh axes through a
chain of `grad_sync` nodes, one per axis: one all-reduce per parameter and
axis in backward. This pass replaces the chains by `grad_bucket` nodes
(`tess_compile.ops.grad_bucket`), each over the parameters of up to
`bucket_bytes` bytes (DistributedDataParallel's default, 25 MiB), filled in
the reverse order of first use, so that the bucket of the last layers is
complete, and reduced, first in backward. Of a model whose layers repeat
(`block_path`, the module path of its repeated blocks,
`tess_compile.passes.repeated_blocks`), no bucket holds the parameters of two
blocks: each block's buckets are alike and reduce as its backward ends, as
FSDP's units are the blocks. The buckets go where the chains
were, before any kernel; each parameter's uses read the bucket's output
instead, which takes over the chain's `meta`. Reads `ROLE`; writes `GLOBAL_NODE` on the
bucket (`tess_compile.core.meta_keys`).
"""

from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

from tess_compile.core.fake_run import local_bytes
from tess_compile.core.mesh import Mesh
from tess_compile.core.meta_keys import GLOBAL_NODE, ROLE
from tess_compile.ops import collectives as c
from tess_compile.ops.grad_bucket import grad_bucket

__all__ = ["BUCKET_BYTES", "bucket_gradients"]

BUCKET_BYTES = 25 * 2**20


def bucket_gradients(gm: GraphModule, mesh: Mesh, *, bucket_bytes: int | None = None,
                     block_path: str | None = None) -> GraphModule:
    """`gm` with its `grad_sync` chains replaced by `grad_bucket` nodes of up to `bucket_bytes`
    (default `BUCKET_BYTES`), none over two of the blocks under `block_path`; see the module docstring."""
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    chains = [chain for chain in map(_chain, gm.graph.nodes) if chain]
    if not chains:
        return gm
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    chains.sort(key=lambda chain: -min((order[user] for user in chain[-1].users), default=len(order)))
    last_sync = max((chain[-1] for chain in chains), key=order.__getitem__)
    with gm.graph.inserting_before(last_sync.next):
        for bucket in _fill(chains, mesh, bucket_bytes, block_path):
            _emit(gm, bucket)
    for chain in chains:
        for node in reversed(chain[1:]):
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _chain(node: Node) -> list[Node]:
    """A parameter's placeholder and its `grad_sync` nodes, in order ([] for other nodes
    and for parameters without any)."""
    if node.op != "placeholder" or ROLE.get(node, ("",))[0] != "param":
        return []
    chain = [node]
    while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target is c.grad_sync:
        chain.append(next(iter(chain[-1].users)))
    return chain if len(chain) > 1 else []


def _fill(chains: list[list[Node]], mesh: Mesh, bucket_bytes: int, block_path: str | None) -> list[list[list[Node]]]:
    """The chains in buckets of at most `bucket_bytes` (a larger parameter alone), none over two blocks,
    in order."""
    buckets: list[list[list[Node]]] = [[]]
    filled = 0
    for chain in chains:
        size = local_bytes(chain[0], mesh)
        if buckets[-1] and (filled + size > bucket_bytes
                            or _block(buckets[-1][-1][0], block_path) != _block(chain[0], block_path)):
            buckets.append([])
            filled = 0
        buckets[-1].append(chain)
        filled += size
    return buckets


def _block(placeholder: Node, block_path: str | None) -> str | None:
    """The repeated block under `block_path` that a parameter belongs to (its index), if any."""
    name = ROLE.of(placeholder)[1]
    if block_path is None or not name.startswith(block_path + "."):
        return None
    return name[len(block_path) + 1:].partition(".")[0]


def _emit(gm: GraphModule, bucket: list[list[Node]]) -> None:
    """One `grad_bucket` node over the bucket's parameters; their uses read its outputs."""
    axes = tuple(tuple(sync.args[1] for sync in chain[1:]) for chain in bucket)
    node = gm.graph.call_function(grad_bucket, ([chain[0] for chain in bucket], axes))
    GLOBAL_NODE.set(node, "gradient bucket")
    for index, chain in enumerate(bucket):
        member = gm.graph.create_node("call_function", operator.getitem, (node, index), name=f"{chain[0].name}_synced")
        member.meta.update(chain[-1].meta)
        chain[-1].replace_all_uses_with(member)
