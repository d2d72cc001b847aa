"""The planner's rows as a chart: predicted step time against memory per rank, as SVG text.

`plan_svg(rows, budget=...)` draws one point per configuration that compiled
(`planner.plan`'s rows): its memory per rank (GB) across, its predicted step
time up, a colour and marker per mode, filled if it fits the memory budget and
hollow if not; the pick (the fastest that fits) ringed and named; the budget
as a dashed vertical line; axes with units and a legend. A point's tooltip names
its configuration and numbers, and says where it ties with the pick
(`PlanRow.tie`). An axis whose values span more than `LOG_SPAN` times is
logarithmic. Plain SVG 1.1 text, no plotting library; the same rows give the
same bytes. `tess-compile plan --plot` writes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from tess_compile.analysis.plan_table import percent
from tess_compile.analysis.planner import GB, PlanRow, mesh_label, pick
from tess_compile.core.mesh import MODES

__all__ = ["LOG_SPAN", "MODE_STYLES", "plan_svg"]

LOG_SPAN = 20.0  # an axis whose largest value is more than this times its smallest is logarithmic
_LOG_PAD = 1.25  # a logarithmic axis runs from its smallest value over this to its largest times this

# mode -> (colour, marker): the Okabe-Ito colours, which colour-blind readers can tell apart.
MODE_STYLES = {"1d": ("#0072B2", "circle"), "2d": ("#E69F00", "square"), "2.5d": ("#009E73", "triangle"),
               "3d": ("#D55E00", "diamond")}

_WIDTH, _HEIGHT = 790, 460
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 560, 50, 390  # the plot area
_LEGEND_X = 585
_SIZE = 6  # marker half-size
_HALO = 'stroke="white" stroke-width="4" paint-order="stroke"'  # keeps a label over markers readable
_BUDGET = 'stroke="#B00020" stroke-width="1.5" stroke-dasharray="6 4"'  # the budget's dashed line


# The corners of the polygon markers, in marker half-sizes from the centre.
_CORNERS = {"triangle": ((0, -1.2), (1.2, 1), (-1.2, 1)), "diamond": ((0, -1.3), (1.3, 0), (0, 1.3), (-1.3, 0))}


class _Axis:
    """A linear or logarithmic map of [low, high] onto [start, end] pixels, with its ticks."""

    def __init__(self, values: Sequence[float], start: float, end: float):
        low, high = min(values), max(values)
        self.log = low > 0 and high / low > LOG_SPAN
        if self.log:
            self.low, self.high = low / _LOG_PAD, high * _LOG_PAD
            self.ticks = _log_ticks(self.low, self.high)
        else:
            step = _nice_step((high - low) or abs(high) or 1.0)
            self.low, self.high = math.floor(low / step) * step, math.ceil(high / step) * step
            if self.high == self.low:
                self.high = self.low + step
            self.ticks = [self.low + k * step for k in range(round((self.high - self.low) / step) + 1)]
        self.start, self.end = start, end

    @property
    def note(self) -> str:
        """What an axis title adds: ", log scale" on a logarithmic axis."""
        return ", log scale" if self.log else ""

    def __call__(self, value: float) -> float:
        if self.log:
            fraction = math.log10(value / self.low) / math.log10(self.high / self.low)
        else:
            fraction = (value - self.low) / (self.high - self.low)
        return self.start + fraction * (self.end - self.start)


def _log_ticks(low: float, high: float) -> list[float]:
    """The powers of ten in [low, high], and 2 and 5 times them where it spans under three decades."""
    factors = (1, 2, 5) if high / low < 1000 else (1,)
    exponents = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    return [f * 10.0 ** e for e in exponents for f in factors if low <= f * 10.0 ** e <= high]


def _nice_step(span: float) -> float:
    """1, 2 or 5 times a power of ten: about five steps over `span`."""
    base = 10.0 ** math.floor(math.log10(span / 5))
    return next(base * k for k in (1, 2, 5, 10) if span / (base * k) <= 6)


def _tick(value: float) -> str:
    """A tick's label: "0.0001", "0.25", "40" (rounding noise of the steps dropped)."""
    return f"{value:.6g}"


def _marker(kind: str, x: float, y: float, colour: str, filled: bool) -> str:
    """A marker of `kind` centred on (x, y): filled with `colour`, or white inside it."""
    fill = colour if filled else "white"
    style = f'fill="{fill}" stroke="{colour}" stroke-width="1.5"'
    s = _SIZE
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{s}" {style}/>'
    if kind == "square":
        return f'<rect x="{x - s:.1f}" y="{y - s:.1f}" width="{2 * s}" height="{2 * s}" {style}/>'
    corners = _CORNERS[kind]
    points = " ".join(f"{x + dx * s:.1f},{y + dy * s:.1f}" for dx, dy in corners)
    return f'<polygon points="{points}" {style}/>'


def _describe(row: PlanRow, seconds: float, unit: str) -> str:
    """A point's tooltip: the configuration and its numbers, and whether it ties with the pick."""
    fits = "fits" if row.fits else "over the memory budget"
    tie = f", tie with the pick (within the {percent(row.error)} error)" if row.tie else ""
    return (f"{row.mode} {mesh_label(row.mesh)}, dp {row.outer.dp}, pp {row.outer.pp}: "
            f"{row.time.step_s * seconds:.4g} {unit}, {row.memory.total / GB:.4g} GB per rank, {fits}{tie}")


def plan_svg(rows: Sequence[PlanRow], *, budget: float, title: str = "tess-compile plan") -> str:
    """The SVG text of the chart of `rows` (`planner.plan`'s, in its order) with the memory
    `budget` (bytes per rank) as a vertical line; see the module docstring."""
    shown = [row for row in rows if row.time is not None]
    if not shown:
        raise ValueError("plan_svg: no configuration compiled, so there is nothing to plot; "
                         "see the rows' notes for why")
    seconds, unit = (1e3, "ms") if max(row.time.step_s for row in shown) < 1 else (1.0, "s")
    x = _Axis([row.memory.total / GB for row in shown] + [budget / GB], _LEFT, _RIGHT)
    y = _Axis([row.time.step_s * seconds for row in shown], _BOTTOM, _TOP)
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
              f'viewBox="0 0 {_WIDTH} {_HEIGHT}" font-family="sans-serif" font-size="12">'),
             f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
             f'<text x="{_LEFT}" y="28" font-size="15">{escape(title)}</text>']
    parts += _axes(x, y, unit)
    parts += _budget_line(x, budget)
    for row in shown:
        colour, kind = MODE_STYLES[row.mode]
        px, py = x(row.memory.total / GB), y(row.time.step_s * seconds)
        parts.append(f'<g class="point" data-mode="{row.mode}"><title>{escape(_describe(row, seconds, unit))}'
                     f'</title>{_marker(kind, px, py, colour, row.fits)}</g>')
    parts += _pick_mark(pick(rows), x, y, seconds)
    parts += _legend([mode for mode in MODES if any(row.mode == mode for row in shown)])
    skipped = len(rows) - len(shown)
    if skipped:
        plural = "s" if skipped > 1 else ""
        parts.append(f'<text x="{_LEFT}" y="{_HEIGHT - 12}" fill="#555">{skipped} configuration{plural} did not '
                     'compile (not shown)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _axes(x: _Axis, y: _Axis, unit: str) -> list[str]:
    """The frame, the ticks with their labels and grid lines, and the axis titles."""
    frame = f'x="{_LEFT}" y="{_TOP}" width="{_RIGHT - _LEFT}" height="{_BOTTOM - _TOP}"'
    out = [f'<rect {frame} fill="none" stroke="#333"/>']
    for value in x.ticks:
        px = x(value)
        out.append(f'<line x1="{px:.1f}" y1="{_TOP}" x2="{px:.1f}" y2="{_BOTTOM + 5}" stroke="#ddd"/>')
        out.append(f'<text x="{px:.1f}" y="{_BOTTOM + 19}" text-anchor="middle">{_tick(value)}</text>')
    for value in y.ticks:
        py = y(value)
        out.append(f'<line x1="{_LEFT - 5}" y1="{py:.1f}" x2="{_RIGHT}" y2="{py:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{_LEFT - 8}" y="{py + 4:.1f}" text-anchor="end">{_tick(value)}</text>')
    middle = (_TOP + _BOTTOM) / 2
    out.append(f'<text x="{(_LEFT + _RIGHT) / 2:.1f}" y="{_BOTTOM + 42}" text-anchor="middle">'
               f'memory per rank (GB{x.note})</text>')
    out.append(f'<text x="22" y="{middle:.1f}" text-anchor="middle" transform="rotate(-90 22 {middle:.1f})">'
               f'predicted step time ({unit}{y.note})</text>')
    return out


def _budget_line(x: _Axis, budget: float) -> list[str]:
    """The dashed vertical line at the budget, named on the side of it with more room."""
    px = x(budget / GB)
    anchor, dx = ("end", -4) if px > (_LEFT + _RIGHT) / 2 else ("start", 4)
    return [f'<line class="budget" x1="{px:.1f}" y1="{_TOP}" x2="{px:.1f}" y2="{_BOTTOM}" {_BUDGET}/>',
            (f'<text x="{px + dx:.1f}" y="{_TOP + 14}" text-anchor="{anchor}" fill="#B00020" {_HALO}>'
             f'memory budget {budget / GB:.4g} GB</text>')]


def _pick_mark(row: PlanRow | None, x: _Axis, y: _Axis, seconds: float) -> list[str]:
    """A ring around the pick and its name beside it (nothing if no configuration fits)."""
    if row is None:
        return []
    px, py = x(row.memory.total / GB), y(row.time.step_s * seconds)
    anchor, dx = ("end", -16) if px > (_LEFT + _RIGHT) / 2 else ("start", 16)
    label = f"pick: {row.mode} {mesh_label(row.mesh)}, dp {row.outer.dp}, pp {row.outer.pp}"
    ring = f'<circle cx="{px:.1f}" cy="{py:.1f}" r="{_SIZE + 6}" fill="none" stroke="black" stroke-width="2"/>'
    text = (f'<text x="{px + dx:.1f}" y="{py + 4:.1f}" text-anchor="{anchor}" font-weight="bold" {_HALO}>'
            f'{escape(label)}</text>')
    return [f'<g class="pick">{ring}{text}</g>']


def _legend(modes: list[str]) -> list[str]:
    """A marker per mode shown, then the meaning of hollow markers, the ring and the dashed line."""
    out = [f'<text x="{_LEGEND_X}" y="{_TOP + 4}" font-weight="bold">mode</text>']
    y = _TOP + 24
    for mode in modes:
        colour, kind = MODE_STYLES[mode]
        out += [_marker(kind, _LEGEND_X + 8, y - 4, colour, True), f'<text x="{_LEGEND_X + 22}" y="{y}">{mode}</text>']
        y += 22
    y += 8
    out += [_marker("circle", _LEGEND_X + 8, y - 4, "#555", False),
            f'<text x="{_LEGEND_X + 22}" y="{y}">hollow: over the budget</text>']
    y += 22
    out += [f'<circle cx="{_LEGEND_X + 8}" cy="{y - 4}" r="{_SIZE + 4}" fill="none" stroke="black" stroke-width="2"/>',
            f'<text x="{_LEGEND_X + 22}" y="{y}">pick: fastest that fits</text>']
    y += 22
    out += [f'<line x1="{_LEGEND_X}" y1="{y - 4}" x2="{_LEGEND_X + 16}" y2="{y - 4}" {_BUDGET}/>',
            f'<text x="{_LEGEND_X + 22}" y="{y}">memory budget</text>']
    return out
