"""Calibration of the cost model: fit a cluster's constants to measured step times, and
rank agreement (Kendall's tau) between predicted and measured times.

An analysis on top of `tess_compile.analysis.cost_model`: it compiles and runs nothing.
An `Observation` is a compiled program's profile (`cost_model.profile_program`)
beside the forward and backward seconds measured for it. The model's time is
linear in the cluster's constants' coefficients (`cost_model.coefficients`):
`t = sum over TERMS of coefficient * term`, and a measurement is `scale * t`,
`scale` unknown (the paper's times are per batch of a model of unstated
depth: `scale` is its number of layers when a profile is one layer).

`fit_cluster` fits the constants named in `free` (each within its physical
`BOUNDS`, in log space) and `scale` by least squares on the log of every
measured forward and backward time: multiplicative errors, so a 10 % miss
weighs the same on a fast and a slow row. `scale` has a closed form (the mean
log residual); the rest is minimised by L-BFGS from several deterministic
starts. The fit is deterministic; on noise-free times made by a cluster
within the bounds it returns that cluster.

`kendall_tau` is tau-b (ties counted as in `scipy.stats.kendalltau`);
`max_kendall_tau` is the largest tau-b any prediction can reach when some
rows must be predicted equal (rows whose programs are the same), solved
exactly as a linear-ordering problem over the groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tess_compile.analysis.accounting import PHASES
from tess_compile.analysis.cost_model import TERMS, ProgramProfile, step_time, time_terms
from tess_compile.core.cluster import Cluster

__all__ = [
    "BOUNDS",
    "FIT_PARAMETERS",
    "Fit",
    "ORDERED",
    "Observation",
    "fit_cluster",
    "format_cluster",
    "format_constant",
    "kendall_tau",
    "max_kendall_tau",
    "predicted_seconds",
]

# The constants a fit may move, and the physical range of each (A100 GPUs, NVLink
# and InfiniBand HDR): a fitted value at an end of its range is reported as such.
BOUNDS: dict[str, tuple[float, float]] = {
    "flops": (50e12, 312e12),  # achieved matmul FLOP/s up to the A100's fp16 dense peak
    "matmul_half_size": (1.0, 1024.0),  # smallest matmul dimension at half the peak rate
    "memory_bandwidth": (0.2e12, 1.555e12),  # bytes/s of memory-bound kernels, up to HBM2's 1555 GB/s
    "kernel_overhead": (1e-6, 100e-6),  # seconds per kernel launch (launch and framework)
    "intra_latency": (0.5e-6, 100e-6),  # seconds per collective step over NVLink
    "inter_latency": (0.5e-6, 200e-6),  # seconds per collective step over InfiniBand
    "intra_bandwidth": (10e9, 300e9),  # bytes/s per rank over NVLink (A100: 300 GB/s each way)
    "inter_bandwidth": (1e9, 25e9),  # bytes/s per rank over InfiniBand (HDR 200 Gb/s = 25 GB/s)
}


# Pairs (a, b) with a <= b on any machine: a step over NVLink takes no longer than one
# over InfiniBand, and InfiniBand moves no more bytes/s than NVLink. A fit keeps them
# ordered (a penalty on the log of the violation) when it fits both.
ORDERED = (("intra_latency", "inter_latency"), ("inter_bandwidth", "intra_bandwidth"))


# The constants fitted by default: all but `flops`, which stays at the GPU's peak
# (the products' rate is `flops * m / (m + matmul_half_size)`), fixing the scale.
FIT_PARAMETERS = ("matmul_half_size", "memory_bandwidth", "kernel_overhead", "intra_latency", "inter_latency",
                  "intra_bandwidth", "inter_bandwidth")


# How each constant enters the coefficients: coefficient = constant ** power (seconds per
# unit of the term), `matmul_flops_per_size` being matmul_half_size / flops.
_POWERS: dict[str, dict[str, int]] = {
    "matmul_flops": {"flops": -1},
    "matmul_flops_per_size": {"matmul_half_size": 1, "flops": -1},
    "memory_bytes": {"memory_bandwidth": -1},
    "kernels": {"kernel_overhead": 1},
    "ops": {"op_overhead": 1},
    "intra_steps": {"intra_latency": 1},
    "inter_steps": {"inter_latency": 1},
    "intra_wire_bytes": {"intra_bandwidth": -1},
    "inter_wire_bytes": {"inter_bandwidth": -1},
}


@dataclass(frozen=True)
class Observation:
    """A program's profile and the forward and backward seconds measured for it."""

    name: str
    profile: ProgramProfile
    forward_s: float
    backward_s: float

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Fit:
    """A fitted cluster, the measured seconds per predicted second (`scale`), the sum of
    squared log errors, the fitted constants that ended at an end of their range,
    and the root-mean-square error as a factor (1.1: typically 10 % off)."""

    cluster: Cluster
    scale: float
    loss: float
    at_bounds: tuple[str, ...]
    num_points: int

    @property
    def typical_error(self) -> float:
        return math.exp(math.sqrt(self.loss / self.num_points))


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b of `x` against `y`: (concordant - discordant pairs) over
    sqrt((pairs not tied in x) * (pairs not tied in y)); nan if either is constant."""
    if len(x) != len(y):
        raise ValueError(f"kendall_tau of {len(x)} and {len(y)} values: pass two sequences of one length")
    score = untied_x = untied_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            sx, sy = _sign(x[i] - x[j]), _sign(y[i] - y[j])
            score += sx * sy
            untied_x += sx != 0
            untied_y += sy != 0
    if untied_x == 0 or untied_y == 0:
        return math.nan
    return score / math.sqrt(untied_x * untied_y)


def max_kendall_tau(groups: Sequence[object], y: Sequence[float]) -> float:
    """The largest tau-b of any prediction against `y` that predicts rows with equal
    `groups` keys equal (and rows of different keys apart).

    With the ties fixed, tau-b's denominator is fixed and its numerator is a sum over
    pairs of groups of +-S(g, h), S(g, h) = sum of sign(y_i - y_j) for i in g, j in h,
    the sign by which group is predicted larger: a linear ordering problem, solved by
    dynamic programming over subsets (2^groups states; use it for up to ~20 groups).
    """
    keys = list(dict.fromkeys(groups))
    if len(keys) > 20:
        raise ValueError(f"max_kendall_tau of {len(keys)} groups: solve it for at most 20")
    index = {key: k for k, key in enumerate(keys)}
    member = [index[g] for g in groups]
    n = len(keys)
    gain = [[0] * n for _ in range(n)]  # gain[g][h]: numerator from ordering g above h
    within = untied_x = untied_y = 0
    for i in range(len(y)):
        for j in range(i + 1, len(y)):
            s = _sign(y[i] - y[j])
            untied_y += s != 0
            if member[i] == member[j]:
                within += 1
                continue
            untied_x += 1
            gain[member[i]][member[j]] += s
            gain[member[j]][member[i]] -= s
    if untied_x == 0 or untied_y == 0:
        return math.nan
    best = [-math.inf] * (1 << n)  # best[mask]: groups of mask ordered, the largest last
    best[0] = 0
    for mask in range(1, 1 << n):
        for g in range(n):
            if mask >> g & 1:
                rest = mask & ~(1 << g)
                score = best[rest] + sum(gain[g][h] for h in range(n) if rest >> h & 1)
                best[mask] = max(best[mask], score)
    return best[(1 << n) - 1] / math.sqrt(untied_x * untied_y)


def _terms(observations: Sequence[Observation], cluster: Cluster, grad_sync: bool) -> torch.Tensor:
    """[observations * phases, TERMS] amounts, float64."""
    rows = []
    for obs in observations:
        terms = time_terms(obs.profile, cluster, grad_sync=grad_sync)
        rows.extend([terms[phase][name] for name in TERMS] for phase in PHASES)
    return torch.tensor(rows, dtype=torch.float64)


def _log_coefficients(cluster: Cluster, free: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(offset, powers)` with log(coefficient of each of TERMS) = offset + powers @ log(free
    constants): offset from the cluster's other constants (-inf where one makes the term
    free, e.g. an infinite memory bandwidth), powers [TERMS, free]."""
    offset = torch.zeros(len(TERMS), dtype=torch.float64)
    powers = torch.zeros(len(TERMS), len(free), dtype=torch.float64)
    for t, name in enumerate(TERMS):
        for constant, power in _POWERS[name].items():
            if constant in free:
                powers[t, free.index(constant)] = power
                continue
            value = getattr(cluster, constant)
            offset[t] += -math.inf if value == 0 or math.isinf(value) else power * math.log(value)
    return offset, powers


def fit_cluster(observations: Sequence[Observation], base: Cluster, *, free: Sequence[str] = FIT_PARAMETERS,
                bounds: dict[str, tuple[float, float]] | None = None, grad_sync: bool = True,
                starts: int = 8) -> Fit:
    """The constants `free` of `base` (each within `bounds`, default `BOUNDS`) and the
    scale that best explain the observations' measured forward and backward seconds
    (least squares on log seconds; see the module docstring), keeping the pairs of
    `ORDERED` in order. `grad_sync=False` prices the programs without the gradient
    all-reduces of replicated parameters. Deterministic: `starts` L-BFGS runs from the
    middle of the box and from fixed pseudo-random points."""
    bounds = BOUNDS if bounds is None else bounds
    for name in free:
        if name not in bounds:
            raise ValueError(f"cannot fit {name!r}: fit some of {', '.join(bounds)}")
    if len(observations) < 2:
        raise ValueError(f"fit_cluster got {len(observations)} observations: pass at least 2")
    free = list(free)
    terms = _terms(observations, base, grad_sync)
    log_terms = torch.where(terms > 0, terms.clamp_min(1e-300).log(), -math.inf)
    offset, powers = _log_coefficients(base, free)
    measured = torch.tensor([[obs.forward_s, obs.backward_s][k] for obs in observations for k in range(2)],
                            dtype=torch.float64).log()
    low = torch.tensor([math.log(bounds[name][0]) for name in free], dtype=torch.float64)
    high = torch.tensor([math.log(bounds[name][1]) for name in free], dtype=torch.float64)

    def log_constants(z: torch.Tensor) -> torch.Tensor:
        return low + (high - low) * torch.sigmoid(z)

    ordered = [(free.index(a), free.index(b)) for a, b in ORDERED if a in free and b in free]

    def penalty(z: torch.Tensor) -> torch.Tensor:
        logs = log_constants(z)
        return sum((torch.relu(logs[a] - logs[b]).pow(2) * 1e3 for a, b in ordered), torch.zeros((), dtype=torch.float64))

    def residuals(z: torch.Tensor) -> torch.Tensor:
        log_c = offset + powers @ log_constants(z)
        r = torch.logsumexp(log_c + log_terms, dim=1) - measured
        return r - r.mean()  # the scale's closed form

    generator = torch.Generator().manual_seed(0)
    best = None
    for start in range(starts):
        # the middle of the box (in log space), then random points of it
        z0 = torch.zeros(len(free), dtype=torch.float64) if start == 0 else \
            6 * torch.rand(len(free), generator=generator, dtype=torch.float64) - 3
        z = z0.requires_grad_(True)
        optimizer = torch.optim.LBFGS([z], lr=1, max_iter=100, tolerance_grad=1e-12, tolerance_change=1e-15,
                                      history_size=20, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = residuals(z).pow(2).sum() + penalty(z)
            loss.backward()
            return loss

        previous = math.inf
        for _ in range(10):  # L-BFGS restarts until the loss settles
            loss = float(optimizer.step(closure).detach())
            if previous - loss < 1e-10:
                break
            previous = loss
        with torch.no_grad():
            loss = float(residuals(z).pow(2).sum() + penalty(z))
        if best is None or loss < best[0] - 1e-12:
            best = (loss, z.detach().clone())
    _, z = best
    with torch.no_grad():
        loss = float(residuals(z).pow(2).sum())
        values = dict(zip(free, log_constants(z).exp().tolist()))
    cluster = replace(base, **values)
    at_bounds = tuple(name for name in free
                      if math.isclose(values[name], bounds[name][0], rel_tol=1e-3)
                      or math.isclose(values[name], bounds[name][1], rel_tol=1e-3))
    predicted = predicted_seconds(observations, cluster, grad_sync=grad_sync)
    logs = [math.log(m) - math.log(p) for obs, (pf, pb) in zip(observations, predicted)
            for m, p in ((obs.forward_s, pf), (obs.backward_s, pb))]
    scale = math.exp(sum(logs) / len(logs))
    return Fit(cluster, scale, loss, at_bounds, len(logs))


def predicted_seconds(observations: Sequence[Observation], cluster: Cluster, *,
                      grad_sync: bool = True) -> list[tuple[float, float]]:
    """(forward, backward) seconds the model predicts for each observation's profile."""
    out = []
    for obs in observations:
        time = step_time(obs.profile, cluster, grad_sync=grad_sync)
        out.append((time.forward_s, time.backward_s))
    return out


_UNITS = {
    "flops": (1e12, "TFLOP/s"),
    "matmul_half_size": (1, ""),
    "memory_bandwidth": (1e9, "GB/s"),
    "kernel_overhead": (1e-6, "us"),
    "intra_latency": (1e-6, "us"),
    "inter_latency": (1e-6, "us"),
    "intra_bandwidth": (1e9, "GB/s"),
    "inter_bandwidth": (1e9, "GB/s"),
}


def format_constant(name: str, value: float) -> str:
    """A constant of `Cluster` in its usual unit, e.g. `25 GB/s` or `8.5 us`."""
    unit, label = _UNITS[name]
    return f"{value / unit:.4g} {label}".rstrip()


def format_cluster(cluster: Cluster, names: Sequence[str] = tuple(_UNITS)) -> str:
    """`name = value unit` lines of a cluster's constants."""
    return "\n".join(f"{name:<17} = {format_constant(name, getattr(cluster, name))}" for name in names)
