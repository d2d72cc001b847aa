"""Long runs of the differential fuzzer of op compositions (tests/fuzz_programs.py, docs/fuzzing.md).

Hypothesis draws `--count` programs on the given meshes and checks each against the unsharded
model. The run goes in sessions: a session draws programs until one fails in a way that no
known minimal failing program explains (another kind, or a kind whose known minimal programs'
ops it does not all contain), then hypothesis shrinks that failure to a minimal program, which
is printed as Python source at once and becomes known; the next session goes on drawing from
another seed (a session draws at most `--session-size` programs). At the end a summary:
programs tried, passed, ValueErrors by message kind, failures by kind with their minimal
programs.

    python3 benchmarks/fuzz.py --count 500 --seed 0 [--meshes 2,2,2.5d 1,2,1d] [--max-steps 6]
                               [--session-size 100] [--shrink-seconds 180] [--no-shrink]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import fuzz_programs as fp
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

__all__ = ["Campaign", "Group", "NovelFailure", "main", "parse_mesh"]

PROGRESS_EVERY = 25
POLISH_SECONDS = 120


class NovelFailure(Exception):
    """A failure no known minimal program explains. Subclassed per kind (`_failure_class`), so that
    hypothesis, which tells failures apart by their exception's type, shrinks each kind apart."""

    def __init__(self, program: fp.Program, outcome: fp.Outcome):
        super().__init__(outcome.kind)
        self.program, self.outcome = program, outcome


_CLASSES: dict[str, type] = {}


def _failure_class(kind: str) -> type:
    if kind not in _CLASSES:
        _CLASSES[kind] = type(f"NovelFailure{len(_CLASSES)}", (NovelFailure,), {})
    return _CLASSES[kind]


@dataclass
class Group:
    """The failures of one kind: how many, on which meshes, and their minimal programs."""

    count: int = 0
    meshes: collections.Counter = field(default_factory=collections.Counter)
    first: tuple | None = None  # (program, outcome) of the first drawn
    minimal: list = field(default_factory=list)  # (program, outcome, shrink runs)


class Campaign:
    """Sessions of hypothesis over `fp.programs`, their tallies and the failures' minimal programs."""

    def __init__(self, meshes, max_steps: int, shrink_seconds: float, shrink: bool = True):
        self.strategy = fp.programs(meshes=meshes, max_steps=max_steps)
        self.shrink_seconds, self.shrink = shrink_seconds, shrink
        self.statuses, self.value_errors = collections.Counter(), collections.Counter()
        self.groups: dict[str, Group] = {}
        self.known: dict[str, list] = collections.defaultdict(list)
        self.shrinking, self.target, self.shrink_runs = fp.Shrinking(shrink_seconds), None, 0
        self.started = time.monotonic()

    @property
    def tried(self) -> int:
        return sum(self.statuses.values())

    def novel(self, program: fp.Program, outcome: fp.Outcome) -> bool:
        """A failure of the session's kind (any, before its first) that no known minimal program explains."""
        if outcome.status not in fp.FAILING or self.target not in (None, outcome.kind):
            return False
        ops = fp.signature(program)
        return not any(known <= ops for known in self.known[outcome.kind])

    def record(self, program: fp.Program, outcome: fp.Outcome) -> None:
        self.statuses[outcome.status] += 1
        if outcome.status == "value_error":
            self.value_errors[outcome.kind] += 1
        elif outcome.status != "pass":
            group = self.groups.setdefault(outcome.kind, Group())
            group.count += 1
            group.meshes[program.mesh] += 1
            group.first = group.first or (program, outcome)
        if self.tried % PROGRESS_EVERY == 0:
            self.progress()

    def progress(self) -> None:
        s = self.statuses
        print(f"[{self.tried}] {s['pass']} passed, {s['value_error']} ValueError, {s['fail']} failed "
              f"({len(self.groups)} kinds), {s['invalid']} invalid; {time.monotonic() - self.started:.0f}s",
              flush=True)

    def run_one(self, program: fp.Program) -> None:
        """The body of a session's test: check (or recall) the program, tally it while the session
        draws; raise if it fails anew (the first such failure fixes the session's kind, so that
        shrinking does not wander to another)."""
        new = repr(program) not in self.shrinking.outcomes
        outcome = self.shrinking.check(program)
        if new and self.target is None:
            self.record(program, outcome)
        if self.novel(program, outcome):
            self.target = outcome.kind
            raise _failure_class(outcome.kind)(program, outcome)

    def session(self, seed: int, count: int) -> None:
        """Draw up to `count` programs from `seed`; shrink the first novel failure, if any."""
        phases = [Phase.generate, Phase.shrink] if self.shrink else [Phase.generate]

        @hypothesis_seed(seed)
        @settings(max_examples=count, phases=phases, database=None, deadline=None, report_multiple_bugs=False,
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, print_blob=False)
        @given(self.strategy)
        def draw(program):
            self.run_one(program)

        self.shrinking, self.target = fp.Shrinking(self.shrink_seconds, starts=self.novel), None
        try:
            draw()
        except NovelFailure as failure:
            program, outcome, runs = failure.program, failure.outcome, self.shrinking.runs
            if self.shrink:
                program, outcome = fp.polish(program, outcome, POLISH_SECONDS, alike=self.novel)
            self.shrink_runs += runs
            self.learn(program, outcome, runs)

    def learn(self, program: fp.Program, outcome: fp.Outcome, runs: int) -> None:
        """A minimal failing program: known from now on, and printed."""
        self.known[outcome.kind].append(fp.signature(program))
        group = self.groups.setdefault(outcome.kind, Group())
        group.minimal.append((program, outcome, runs))
        print(f"\n=== new failure: {outcome.kind}\n(shrunk in {runs} runs)\n{fp.source(program)}"
              f"# {_first_lines(outcome.message)}\n", flush=True)

    def run(self, count: int, seed: int, session_size: int) -> None:
        """Sessions of at most `session_size` programs (each from its own seed: hypothesis drifts
        towards the programs it drew first) until `count` programs were tried."""
        session = 0
        while self.tried < count:
            before = self.tried
            self.session(seed * 1000 + session, min(session_size, count - self.tried))
            session += 1
            if self.tried == before and self.target is None:
                break  # hypothesis drew nothing new: the space is exhausted

    def summary(self) -> str:
        s, lines = self.statuses, []
        lines.append(f"programs tried: {self.tried}: {s['pass']} passed, {s['value_error']} ValueError, "
                     f"{s['fail']} failed, {s['invalid']} invalid (the grammar's own defects); "
                     f"{self.shrink_runs} shrink runs; {time.monotonic() - self.started:.0f}s")
        lines.append("\nValueErrors by message kind:")
        lines += [f"  {n:5d}  {kind}" for kind, n in self.value_errors.most_common()]
        lines.append("\nfailures by kind:")
        for kind, group in sorted(self.groups.items(), key=lambda item: -item[1].count):
            meshes = ", ".join(f"{list(mesh)} x{n}" for mesh, n in group.meshes.most_common())
            lines.append(f"  {group.count:5d}  {kind}  (meshes: {meshes})")
        for kind, group in self.groups.items():
            shown = [(program, outcome, f"minimal, {runs} shrink runs") for program, outcome, runs in group.minimal]
            for program, outcome, how in shown or [(*group.first, "as drawn, not shrunk")]:
                lines += [f"\n--- {kind} ({how})", fp.source(program), f"# {_first_lines(outcome.message)}"]
        return "\n".join(lines)


def _first_lines(text: str, num_lines: int = 4) -> str:
    return "\n# ".join(text.strip().splitlines()[:num_lines])


def parse_mesh(text: str) -> tuple[int, int, str]:
    """'2,2,2.5d' -> (2, 2, '2.5d')."""
    q, d, mode = text.split(",")
    return int(q), int(d), mode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="programs to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--meshes", nargs="+", type=parse_mesh, default=list(fp.MESHES),
                        help="q,d,mode triples (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=fp.MAX_STEPS)
    parser.add_argument("--shrink-seconds", type=float, default=180.0, help="time to shrink each new failure")
    parser.add_argument("--session-size", type=int, default=100, help="programs a hypothesis session draws at most")
    parser.add_argument("--no-shrink", action="store_true", help="report failures as drawn")
    args = parser.parse_args(argv)
    campaign = Campaign(args.meshes, args.max_steps, args.shrink_seconds, shrink=not args.no_shrink)
    campaign.run(args.count, args.seed, args.session_size)
    print("\n" + campaign.summary())
    return 1 if campaign.statuses["fail"] or campaign.statuses["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
