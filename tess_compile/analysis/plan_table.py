"""The planner's rows as text: `format_table` prints `planner.plan`'s rows as a fixed-width table
(`HEADER` its columns), with a last line on the cluster's measured error of predicted step times
where it is known; `percent` writes a relative error as a percentage."""

from __future__ import annotations

from collections.abc import Sequence

from tess_compile.analysis.candidate_meshes import mesh_label
from tess_compile.analysis.planner import GB, PlanRow

__all__ = ["HEADER", "format_table", "percent"]


HEADER = ("mode", "dp", "pp", "mesh", "forward s", "backward s", "step s", "comm MB/rank", "saved GB/rank", "memory GB/rank",
          "redundant work", "note")


def format_table(rows: Sequence[PlanRow]) -> str:
    """The rows as a fixed-width text table, one line per row, in the given order; where the
    rows' error is measured, a tie's step time marked `~` and a last line that says the error."""
    cells = [HEADER] + [_cells(row) for row in rows]
    widths = [max(len(line[col]) for line in cells) for col in range(len(HEADER) - 1)]
    lines = []
    for line in cells:
        head = [line[0].ljust(widths[0]), line[1].rjust(widths[1]), line[2].rjust(widths[2]), line[3].ljust(widths[3])]
        head += [text.rjust(width) for text, width in zip(line[4:-1], widths[4:])]
        lines.append("  ".join(head + [line[-1]]).rstrip())
    error = rows[0].error if rows else None
    if error is not None:
        lines.append(_error_line(error, any(row.tie for row in rows)))
    return "\n".join(lines) + "\n"


def _error_line(error: float, ties: bool) -> str:
    """The table's last line: how far off its step times are, and what that makes of the rows."""
    reading = "rows marked ~ are within that of the pick: ties" if ties else "no other row that fits is that close"
    return f"# predicted step times are {percent(error)} off on this machine (the cluster's time_error); {reading}"


def percent(error: float) -> str:
    """A relative error as a percentage: "8.3%", "12%"."""
    return f"{100 * error:.3g}%"


def _cells(row: PlanRow) -> tuple[str, ...]:
    outer = (row.mode, str(row.outer.dp), str(row.outer.pp), mesh_label(row.mesh))
    if row.time is None:
        return (*outer, "-", "-", "-", "-", "-", "-", "-", row.note)
    numbers = (row.time.forward_s, row.time.backward_s, row.time.step_s, row.time.comm_bytes / 1e6,
               row.memory.activations / GB, row.memory.total / GB)
    forward, backward, step, *rest = map(_number, numbers)
    redundant = "-" if row.redundant_work is None else f"{row.redundant_work:.2f}"
    return (*outer, forward, backward, f"~{step}" if row.tie else step, *rest, redundant, row.note)


def _number(value: float) -> str:
    """Four significant digits; whole numbers from 10000 up (no exponent)."""
    return f"{value:.0f}" if value >= 1e4 else f"{value:.4g}"
