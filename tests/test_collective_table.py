"""The one table of collectives (`tess_compile.core.collective_table`) and the schedule table.

- every adjoint is a record; the adjoint of the adjoint is the op itself (as it counts), and
  on one group's tensors each op's adjoint is its transpose: sum <f(x), y> = sum <x, f*(y)>;
- each op's group results (the simulator's and the threaded runs') equal what `DistComm`
  computes over torch.distributed, on a 3-rank group whose ranks run in threads
  (torch.distributed's calls stubbed by an exchange between the threads), and have the
  shape of its fake kernel;
- each price rule gives the numbers of the rules it replaced;
- the cost model and the schedule choice price a matrix product alike, to the bit;
- `SCHEDULES` names the schedule table's records.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tess_compile.analysis.cost_model import ProgramProfile, step_time
from tess_compile.analysis.kernels import PhaseProfile, kernel_profile
from tess_compile.core.cluster import ALGORITHMS, CALIBRATED_CLUSTER, COLLECTIVE_RULES, PAPER_CLUSTER
from tess_compile.core.collective_table import COLLECTIVES
from tess_compile.core.mesh import Mesh
from tess_compile.core.options import SCHEDULES
from tess_compile.ops import collectives as c
from tess_compile.passes.product_schedule import ProductPrices
from tess_compile.passes.summa import SCHEDULE_TABLE
from tess_compile.runtime.dist_comm import DistComm

MESH = Mesh(1, 3, "1d")  # one group of 3 ranks along col
RANKS = MESH.num_ranks

# (op, this rank's input shape, the op's own arguments): blocks in rank order and not, with groups.
CASES = [
    ("broadcast", (2, 5), (1,)),
    ("broadcast_start", (2, 5), (2,)),
    ("reduce", (2, 5), (1,)),
    ("all_reduce", (2, 5), ()),
    ("keep_first", (2, 5), ()),
    ("all_gather", (2, 4), (RANKS, 0, 1)),
    ("all_gather", (2, 4), (RANKS, 1, 1)),
    ("all_gather", (4, 2), (RANKS, 0, 2)),
    ("reduce_scatter", (6, 4), (RANKS, 0, 1)),
    ("reduce_scatter", (2, 12), (RANKS, 1, 2)),
    ("shard_slice", (2, 6), (RANKS, 1, 1)),
    ("shard_slice", (12, 2), (RANKS, 0, 2)),
    ("shard_pad", (2, 4), (RANKS, 1, 1)),
    ("shard_pad", (4, 2), (RANKS, 0, 2)),
    ("grad_sync", (2, 5), ()),
    ("seed_once", (2, 5), ()),
    ("sum_shares", (2, 5), ()),
    ("identity", (2, 5), ()),
    ("all_reduce_alike", (2, 5), ()),
    ("keep_first_alike", (2, 5), ()),
    ("all_gather_alike", (4, 2), (RANKS, 0, 2)),
]


def _case_id(case) -> str:
    name, shape, args = case
    return f"{name}-{'x'.join(map(str, shape))}-{'-'.join(map(str, args))}"


def _inputs(shape, seed: int = 0) -> list[torch.Tensor]:
    """Each rank's tensor: small integers, so that every sum is exact in any order."""
    return [torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed + r)).double()
            for r in range(RANKS)]


def test_every_adjoint_is_a_collective_and_pairs_back():
    for name, record in COLLECTIVES.items():
        adjoint = COLLECTIVES[record.adjoint]
        if record.schema is None:  # an identity forward: its backward is a collective that is its own adjoint
            assert COLLECTIVES[adjoint.adjoint] is adjoint, name
        elif record.whole_gradient:  # the rank-local part of its counterpart's adjoint: same shape, no bytes
            assert not adjoint.sends and adjoint.scale == COLLECTIVES[COLLECTIVES[record.counts_as].adjoint].scale
        else:
            assert adjoint.adjoint == record.counts_as, name
            assert adjoint.sends == record.sends, name


def test_every_collective_is_a_graph_target_of_its_schema():
    for name, record in COLLECTIVES.items():
        target = getattr(c, name)
        assert c.COLLECTIVE_OPS[target] == record.counts_as
        if record.schema is not None:
            assert str(target._schema) == f"tess::{name}{record.schema}"


@pytest.mark.parametrize("case", [k for k in CASES if COLLECTIVES[k[0]].schema is not None
                                  and not COLLECTIVES[k[0]].whole_gradient], ids=_case_id)
def test_the_adjoint_is_the_transpose(case):
    name, shape, args = case
    record = COLLECTIVES[name]
    xs = _inputs(shape)
    fx = record.group_results(xs, *args)
    ys = _inputs(fx[0].shape, seed=10)
    adjoint_ys = COLLECTIVES[record.adjoint].group_results(ys, *args)
    forward = sum(float((f * y).sum()) for f, y in zip(fx, ys, strict=True))
    backward = sum(float((x * a).sum()) for x, a in zip(xs, adjoint_ys, strict=True))
    assert forward == backward


@pytest.mark.parametrize("case", [k for k in CASES if COLLECTIVES[k[0]].whole_gradient], ids=_case_id)
def test_a_whole_gradient_adjoint_gives_each_rank_its_whole_gradient(case):
    """Where every rank holds the whole gradient `y` of the op's result (the same on every rank), the
    adjoint gives each rank the whole gradient of its input: of a block (all_gather_alike) or of a
    summand (all_reduce_alike), its own; of a value replicated before keep_first, all of it. Each
    equals the derivative of the loss <result, y>, counted once (a replicated result: on one rank;
    keep_first's partial sums: summed over the ranks)."""
    name, shape, args = case
    record = COLLECTIVES[name]
    xs = [x.requires_grad_() for x in _inputs(shape)]
    if name == "keep_first_alike":
        xs = [xs[0]] * RANKS  # a replicated input
    fx = record.group_results(xs, *args)
    y = _inputs(fx[0].shape, seed=10)[0]
    loss = sum((f * y).sum() for f in fx) if name == "keep_first_alike" else (fx[0] * y).sum()
    expected = torch.autograd.grad(loss, xs[0])[0]
    assert torch.equal(COLLECTIVES[record.adjoint].group_results([y] * RANKS, *args)[0], expected)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_group_results_have_the_fake_kernels_shape(case):
    name, shape, args = case
    record = COLLECTIVES[name]
    xs = _inputs(shape)
    assert [r.shape for r in record.group_results(xs, *args)] == [record.output_like(xs[0], "col", *args).shape] * RANKS


class _Group:
    """One process group whose members run in threads: each call exchanges every member's tensor."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list = [None] * size

    def exchange(self, index: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[index] = x.clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()  # all have read before the slots are written again
        return every


@dataclass
class _Member:
    """What a stubbed torch.distributed call is given as `group`: the group and this rank's index in it."""

    group: _Group
    index: int

    def every(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.group.exchange(self.index, x)


class _Done:
    def wait(self) -> None:
        pass


def _broadcast(out, group, group_src, async_op=False):
    out.copy_(group.every(out)[group_src])
    return _Done() if async_op else None


def _reduce(out, group, group_dst):
    total = functools.reduce(torch.add, group.every(out))
    if group.index == group_dst:
        out.copy_(total)


def _all_reduce(out, group):
    out.copy_(functools.reduce(torch.add, group.every(out)))


def _all_gather_single(out, x, group):
    out.copy_(torch.cat(group.every(x)))


def _reduce_scatter_single(out, x, group):
    out.copy_(functools.reduce(torch.add, group.every(x)).view(RANKS, -1)[group.index])


class _DeviceMesh:
    """What DistComm reads of a DeviceMesh, for `rank` of `MESH`."""

    def __init__(self, rank: int):
        self.rank = rank
        self.mesh = torch.arange(RANKS).view(MESH.shape)

    def get_coordinate(self):
        return list(MESH.coords(self.rank))


@pytest.fixture
def threaded_dist(monkeypatch):
    for name, stub in [("broadcast", _broadcast), ("reduce", _reduce), ("all_reduce", _all_reduce),
                       ("all_gather_single", _all_gather_single), ("reduce_scatter_single", _reduce_scatter_single)]:
        monkeypatch.setattr(dist, name, stub)


def _over_process_groups(name: str, xs: list[torch.Tensor], args: tuple) -> list[torch.Tensor]:
    """Each rank's result of `name` by `DistComm.run`, every rank in its thread."""
    group = _Group(RANKS)
    comms = [DistComm(MESH, _DeviceMesh(r), timedelta(seconds=30), groups={"depth": None, "row": None,
                                                                          "col": _Member(group, r)})
             for r in range(RANKS)]

    def run(rank: int) -> torch.Tensor:
        return comms[rank].wait(comms[rank].run(name, xs[rank], "col", *args))

    with ThreadPoolExecutor(max_workers=RANKS) as pool:
        return list(pool.map(run, range(RANKS)))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_group_results_are_what_dist_comm_computes(threaded_dist, case):
    name, shape, args = case
    xs = _inputs(shape)
    expected = COLLECTIVES[name].group_results(xs, *args)
    got = _over_process_groups(name, xs, args)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True)), (expected, got)


G = (2, 3, 4, 8)
# The rules that core/cluster.py held before the table: (algorithm, op) -> (steps, factor) at each of G.
OLD_PRICES = {
    ("ring", "broadcast"): [(1, 1), (2, 1), (3, 1), (7, 1)],
    ("ring", "reduce"): [(1, 1), (2, 1), (3, 1), (7, 1)],
    ("ring", "all_reduce"): [(2, 1.0), (4, 4 / 3), (6, 1.5), (14, 1.75)],
    ("ring", "all_gather"): [(1, 1), (2, 2), (3, 3), (7, 7)],
    ("ring", "reduce_scatter"): [(1, 0.5), (2, 2 / 3), (3, 0.75), (7, 0.875)],
    ("tree", "broadcast"): [(1, 1), (2, 2), (2, 2), (3, 3)],
    ("tree", "reduce"): [(1, 1), (2, 2), (2, 2), (3, 3)],
    ("tree", "all_reduce"): [(1, 1), (2, 2), (2, 2), (3, 3)],
    ("tree", "all_gather"): [(1, 1), (2, 2), (2, 3), (3, 7)],
    ("tree", "reduce_scatter"): [(1, 0.5), (2, 2 / 3), (2, 0.75), (3, 0.875)],
}


def test_each_price_rule_gives_the_old_numbers():
    assert set(COLLECTIVE_RULES) == set(OLD_PRICES)
    for (algorithm, op), numbers in OLD_PRICES.items():
        assert [COLLECTIVES[op].price[algorithm](g) for g in G] == numbers, (algorithm, op)


def test_the_priced_ops_are_the_communicating_ones():
    priced = [name for name, record in COLLECTIVES.items() if record.price]
    assert tuple(priced) == c.COMMUNICATING == ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter")
    assert all(set(COLLECTIVES[name].price) == set(ALGORITHMS) for name in priced)
    assert all(COLLECTIVES[record.counts_as].price for record in COLLECTIVES.values() if record.sends)


@pytest.mark.parametrize("cluster", [CALIBRATED_CLUSTER, PAPER_CLUSTER], ids=["calibrated", "paper"])
def test_the_cost_model_and_the_schedule_choice_price_a_product_alike(cluster):
    x, w = torch.empty(64, 48), torch.empty(48, 32)
    profile = ProgramProfile(MESH, kernel_profile(lambda: torch.mm(x, w)), PhaseProfile(), ())
    assert step_time(profile, cluster).forward_compute_s == ProductPrices(MESH, cluster).product(64, 48, 32)


def test_schedules_name_the_schedule_table():
    assert tuple(SCHEDULE_TABLE) == SCHEDULES
    assert all(name == schedule.name for name, schedule in SCHEDULE_TABLE.items())
