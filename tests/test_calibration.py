"""Calibration: Kendall's tau on small exact cases, the largest tau under ties against brute
force, the fit recovering known constants from synthetic times, and the shipped
calibration against the Tesseract paper's tables (deterministic: the model runs
nothing; each paper row is compiled once, on the meta device)."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from tess_compile.analysis.calibration import (
    BOUNDS,
    FIT_PARAMETERS,
    Observation,
    fit_cluster,
    format_cluster,
    kendall_tau,
    max_kendall_tau,
    predicted_seconds,
)
from tess_compile.core.cluster import CALIBRATED_CLUSTER, PAPER_CLUSTER

# --------------------------------------------------------------------------- Kendall's tau


def test_kendall_tau_small_exact_cases():
    # one swapped pair of six: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    # tau-b: x ties the first pair; 2 concordant of 2 pairs untied in x, 3 untied in y
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(2 * 3))
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="kendall_tau of 2 and 3 values"):
        kendall_tau([1, 2], [1, 2, 3])


def test_kendall_tau_matches_scipy_when_available():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for _ in range(20):
        x = [rng.choice([1, 2, 3, 4]) for _ in range(9)]
        y = [rng.random() for _ in range(9)]
        assert kendall_tau(x, y) == pytest.approx(stats.kendalltau(x, y).statistic)


def test_max_kendall_tau_small_cases():
    assert max_kendall_tau([1, 2, 3], [3, 1, 2]) == pytest.approx(1.0)
    # rows 0 and 2 predicted equal, row 1 measured between them: either order loses a pair
    assert max_kendall_tau(["a", "b", "a"], [1, 2, 3]) == 0.0


def test_max_kendall_tau_is_the_best_of_every_ordering():
    rng = random.Random(1)
    for _ in range(5):
        groups = [rng.choice("abcd") for _ in range(8)]
        y = [rng.random() for _ in range(8)]
        keys = sorted(set(groups))
        brute = max(kendall_tau([order.index(g) for g in groups], y) for order in itertools.permutations(keys))
        assert max_kendall_tau(groups, y) == pytest.approx(brute)


# --------------------------------------------------------------------------- the paper's tables


class _PerTable(dict):
    """Paper table ("1", "2") -> a value, computed on first use (a table's rows compile in seconds)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, table):
        self[table] = value = self.make(table)
        return value


@pytest.fixture(scope="module")
def paper():
    """The paper-times benchmark, its tables' observations (each row compiled once per process) and fits."""
    import benchmarks.paper_times as bench

    observations = _PerTable(lambda table: bench.observations(bench.TABLES[table][1]))
    fits = _PerTable(lambda table: fit_cluster(observations[table], bench.FIT_BASE, grad_sync=bench.GRAD_SYNC))
    return bench, observations, fits


@pytest.mark.slow  # a full fit (about 8 s); the fast tier's Table 1 fit below covers the feature
def test_fit_recovers_known_constants_from_synthetic_times(paper):
    """Times made by a known cluster (inside the bounds) on Table 1's programs, times 20
    layers: the fit returns that cluster and that scale."""
    bench, observations, _ = paper
    truth = replace(bench.FIT_BASE, matmul_half_size=200.0, memory_bandwidth=1.0e12, kernel_overhead=8e-6,
                    intra_latency=3e-6, inter_latency=12e-6, intra_bandwidth=150e9, inter_bandwidth=12e9)
    times = predicted_seconds(observations["1"], truth, grad_sync=False)
    synthetic = [Observation(o.name, o.profile, 20 * f, 20 * b) for o, (f, b) in zip(observations["1"], times)]
    fit = fit_cluster(synthetic, bench.FIT_BASE, grad_sync=False)
    for name in FIT_PARAMETERS:
        assert getattr(fit.cluster, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    assert fit.scale == pytest.approx(20, rel=1e-6)
    assert fit.loss < 1e-12 and fit.at_bounds == ()


def test_fit_refuses_unknown_constants(paper):
    _, observations, _ = paper
    with pytest.raises(ValueError, match="cannot fit 'warp_speed'"):
        fit_cluster(observations["1"], PAPER_CLUSTER, free=("warp_speed",))
    with pytest.raises(ValueError, match="pass at least 2"):
        fit_cluster(observations["1"][:1], PAPER_CLUSTER)


def test_calibrated_cluster_is_the_fit_to_table_1(paper):
    _, _, fits = paper
    for name in ("flops", *FIT_PARAMETERS):
        assert getattr(fits["1"].cluster, name) == pytest.approx(getattr(CALIBRATED_CLUSTER, name), rel=1e-3), name
        low, high = BOUNDS[name]
        assert low * (1 - 1e-9) <= getattr(CALIBRATED_CLUSTER, name) <= high * (1 + 1e-9), name
    assert "matmul_half_size  = 1024" in format_cluster(CALIBRATED_CLUSTER)


@pytest.mark.slow  # compiles Table 2's rows as well
def test_paper_taus(paper):
    """The taus docs/planner.md reports (fwd+bwd over each table's rows), as floors."""
    bench, observations, fits = paper
    # no model of these programs can do better: Optimus [q,q] and Tesseract [q,q,1] are one program
    assert bench.best_tau(observations["1"]) == pytest.approx(0.667, abs=1e-3)
    assert bench.best_tau(observations["2"]) == pytest.approx(0.824, abs=1e-3)
    assert bench.tau(CALIBRATED_CLUSTER, observations["1"]) >= 0.41  # fitted: 0.419
    assert bench.tau(CALIBRATED_CLUSTER, observations["2"]) >= 0.57  # held out: 0.577
    assert bench.tau(fits["2"].cluster, observations["2"]) >= 0.57  # fitted: 0.577
    assert bench.tau(fits["2"].cluster, observations["1"]) >= 0.38  # held out: 0.388
    assert bench.tau(PAPER_CLUSTER, observations["1"]) >= 0.29  # uncalibrated: 0.295
    assert bench.tau(PAPER_CLUSTER, observations["2"]) >= 0.74  # uncalibrated: 0.741
    # the calibrated model predicts each table's times better than the uncalibrated one
    for table in ("1", "2"):
        assert bench.typical_error(CALIBRATED_CLUSTER, observations[table]) < \
            bench.typical_error(PAPER_CLUSTER, observations[table])
