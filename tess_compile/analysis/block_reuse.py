"""The analyses of a program compiled with block reuse, priced from two short forms of it.

A program compiled with block reuse (`Program.repeats`, `tess_compile.passes.expand_blocks`) is
a first block, `middle` alike blocks (the first of them compiled, the others copies of the
second) and a last one. `Repeats.short(m)` is the same program with m middle blocks. Every
analysis that runs a program on fake tensors (bytes, FLOPs, kernels, saved activations, the
step's peak) runs the short programs with 2 and 3 middle blocks, never the whole one, and
extends what they measure to `middle` blocks:

- a sum over the program (FLOPs, kernels, saved bytes: `extended`) grows by the same amount per
  block: the 3-block value less the 2-block one, `middle - 2` times;
- the collectives (`extended_costs`): the 2-block program's, and those of the 3-block program's
  added copy once more per block;
- the step's peak (`extended_peak`): a step's memory over time, each moment labelled by the
  block whose op runs (`Repeats.labels`), is the 2-block program's, each moment shifted by what
  each further block adds there: outside the copies by what the third block added at that
  moment; in a copy, by the larger of what a copy before it and a copy after it add (the first
  and the second copy of the 3-block program), so that the peak over the copies is that of the
  first or the last. Where the two short programs' moments do not line up, None: the caller
  runs the whole program.

These are exact where each middle block adds the same: its nodes are copies, and the gradient
buckets of such a program never span two blocks (`passes/bucket_gradients.py`), so each block's
are its own. A program compiled only to be priced (`compile_model(priced_only=True)`) holds the
short per-rank graph in place of the whole, which is never built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from torch.fx import Node

from tess_compile.core.program import Program

__all__ = ["added_block", "extended", "extended_peak"]

log = logging.getLogger("tess_compile")

# A moment of a step's memory: the label of the block whose op ran (None: none), and the bytes held after it.
Moment = tuple[object, int]


def extended(program: Program, measure: Callable[[Program], object]):
    """`measure(program)` (a number, or a dataclass of numbers) from the short programs with 2 and 3
    middle blocks: the 2-block value and, per further block, the difference."""
    repeats = program.repeats
    two, three = measure(repeats.short(2)), measure(repeats.short(3))
    return _add(two, three, repeats.middle - 2)


def _add(two, three, times: int):
    if dataclasses.is_dataclass(two):
        changes = {field.name: _add(getattr(two, field.name), getattr(three, field.name), times)
                   for field in dataclasses.fields(two) if isinstance(getattr(two, field.name), (int, float))}
        return dataclasses.replace(two, **changes)
    return two + times * (three - two)


def added_block(program: Program) -> set[Node]:
    """The nodes of the copy that the short program with 3 middle blocks adds (block 3)."""
    short = program.repeats.short(3)
    return {node for node, label in program.repeats.labels(short).items() if label == 3}


def extended_peak(program: Program, timeline: Callable[[Program], Sequence[Moment]]) -> int | None:
    """The most bytes a step of `program` holds, from `timeline` of its short programs with 2 and 3
    middle blocks (see the module docstring); None where their moments do not line up."""
    repeats = program.repeats
    two, three = _stretches(timeline(repeats.short(2)), 2), _stretches(timeline(repeats.short(3)), 3)
    if [kind for kind, _ in two] != [kind for kind, _ in three]:
        log.info("block reuse: the short programs' steps do not line up; the whole program's peak is measured")
        return None
    further = repeats.middle - 2
    peak = 0
    for (kind, runs2), (_, runs3) in zip(two, three):
        if kind[0] != "copies":
            (base,), (more,) = runs2, runs3
            peak = max(peak, *(b + further * (m - b) for b, m in zip(base, more)))
            continue
        (base,), (first, second) = runs2, runs3
        peak = max(peak, *(b + further * max(f - b, s - b) for b, f, s in zip(base, first, second)))
    return peak


def _stretches(moments: Sequence[Moment], middle: int) -> list[tuple[tuple, list[list[int]]]]:
    """The moments in stretches of one label (a moment that holds what the one before it held dropped:
    views, such as a gradient bucket's of each member, come and go with the blocks), those of the
    middle copies (labels 2 .. `middle`) gathered: `(("copies", length), [bytes of each copy's stretch])` where each copy's stretch follows
    the one before (in forward's or backward's order), `(("block", label, length), [bytes])` for the
    others. Copies out of order or of unequal lengths are a kind of their own, which lines up with
    nothing."""
    runs: list[tuple[object, list[int]]] = []
    for label, held in moments:
        if runs and runs[-1][0] == label:
            if held != runs[-1][1][-1]:  # an op that held nothing new (a view) moves nothing
                runs[-1][1].append(held)
        else:
            runs.append((label, [held]))
    copies = set(range(2, middle + 1))
    stretches: list[tuple[tuple, list[list[int]]]] = []
    index = 0
    while index < len(runs):
        label, held = runs[index]
        if label not in copies:
            stretches.append((("block", label, len(held)), [held]))
            index += 1
            continue
        group = [runs[index]]
        while index + len(group) < len(runs) and len(group) < len(copies) and runs[index + len(group)][0] in copies:
            group.append(runs[index + len(group)])
        labels = [label for label, _ in group]
        lengths = {len(held) for _, held in group}
        ordered = labels in (sorted(copies), sorted(copies, reverse=True)) and len(lengths) == 1
        kind = ("copies", len(held)) if ordered else ("unordered", tuple(labels), tuple(sorted(lengths)))
        stretches.append((kind, [held for _, held in group]))
        index += len(group)
    return stretches
