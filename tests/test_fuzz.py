"""The differential fuzzer of op compositions (tests/fuzz_programs.py, docs/fuzzing.md): every
program the grammar draws either matches the unsharded model (float64: the outputs and every
parameter gradient to 1e-12 of the model's scale) or is refused at compile time by a ValueError
that names the mesh.

Fixed programs: `NUM_FIXED` drawn by `random_program` from the seeds 0 to NUM_FIXED - 1, one test
each, whose failure prints the program's source; the fast tier runs `FAST_SEEDS` of them, which
together use every op of the grammar on every mesh, the slow tier the rest. Fast tier: those, the
minimal programs of the defects the fuzzer found (`FOUND`), and the first fixed programs also in
float32 under bfloat16 autocast (`fp.check_autocast`: dtypes as the unsharded model's, nothing
failing), more in the slow tier. Slow tier: the other fixed programs, and hypothesis draws more
and shrinks a failure to a minimal program (within a time budget). Long runs: `python3 benchmarks/fuzz.py --count N --seed S`.
"""

from __future__ import annotations

import copy
import warnings

import fuzz_programs as fp
import pytest
import torch
from fuzz_programs import Program, Step
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.control import current_build_context

import tess_compile

NUM_FIXED = 200
# The fixed programs of the fast tier: seeds whose programs together resolve every op of the grammar and run on
# every mesh (picked greedily, the cheapest first); the other seeds below NUM_FIXED run in the slow tier.
FAST_SEEDS = (6, 19, 20, 37, 38, 64, 80, 84, 88, 106, 118, 196)

# Minimal programs of the defects the fuzzer found (docs/fuzzing.md), as they were shrunk: regression
# tests, whose meaning is the grammar's resolution of them at the time (check `fp.source` after changing it).
FOUND = {
    "latent-values-whole-over-a-token-split": Program(mesh=(2, 1, "1d"), seq=4, features=1, vocab=2, start=6,
                                                      steps=(Step("latent_attention", (0, 0, 0, 0, 0)),), end=0),
    "addmm-out1-view-1d": Program(mesh=(2, 1, "1d"), features=1, end=57, steps=(Step("matmul", (0, 55, 0, 0, 0)),)),
    "unit-split-expand": Program(mesh=(2, 2, "2.5d"), steps=(Step("linear"), Step("expand"), Step("linear"))),
    "unit-split-heads-1d": Program(mesh=(2, 1, "1d"), end=1, steps=(Step("linear"), Step("heads"))),
    "unflatten-batch-unit-split": Program(mesh=(2, 2, "2.5d"), steps=(Step("linear"), Step("unflatten"))),
    "batch-last-plus-position-table": Program(mesh=(2, 2, "2.5d"), steps=(Step("permute", (0, 17, 0, 0, 0)),
                                                                           Step("embed"))),
    "gram-of-one-token-split-unevenly": Program(mesh=(2, 1, "2.5d"), seq=1, features=11, vocab=17, start=14, end=8,
                                                tokens="split", steps=(Step("embed", (28, 62, 31, 58, 3)),
                                                                       Step("gram", (48, 45, 33, 45, 18)))),
}


def _assert_exact_or_refused(program: fp.Program, outcome: fp.Outcome | None = None) -> None:
    outcome = outcome or fp.check(program)
    assert outcome.status in ("pass", "value_error"), (
        f"{outcome.status}: {outcome.kind}\n{outcome.message}\n\n{fp.source(program)}"
    )


@pytest.mark.parametrize("seed", [pytest.param(seed, marks=() if seed in FAST_SEEDS else (pytest.mark.slow,))
                                  for seed in range(NUM_FIXED)])
def test_fixed_program(seed):
    _assert_exact_or_refused(fp.random_program(seed))


@pytest.mark.parametrize("name", list(FOUND))
def test_found_program(name):
    _assert_exact_or_refused(FOUND[name])


def test_fixed_programs_cover_the_grammar():
    """The fast tier's fixed programs resolve every op of the grammar and run on every mesh."""
    programs = [fp.random_program(seed) for seed in FAST_SEEDS]
    resolved = set().union(*(fp.signature(program) for program in programs))
    assert not set(fp.OPS) - resolved, f"ops no fixed program resolves: {sorted(set(fp.OPS) - resolved)}"
    assert {program.mesh for program in programs} == set(fp.MESHES)


def test_source_is_the_module_that_runs():
    """The printed source runs as it is and builds the very module the fuzzer checked."""
    program = fp.random_program(3)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what runs replicated
        exec(compile(fp.source(program), "<source>", "exec"), namespace)  # noqa: S102
    inputs = fp.example_inputs(program)
    expected = fp.build_model(program)(*inputs)
    for got, want in zip(namespace["expected"], expected):
        assert torch.equal(got, want)


def test_a_wrong_gradient_is_caught():
    """The oracle is strict: a weight off by one part in 1e10 fails the comparison."""
    program = fp.Program(mesh=(2, 1, "2.5d"), blocks=1, seq=3, features=4, steps=(fp.Step("linear"),))
    model, inputs = fp.build_model(program), fp.example_inputs(program)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.lin1.weight.mul_(1 + 1e-10)
    sim = tess_compile.simulate(model, 2, 1, example_inputs=inputs)
    with pytest.raises(AssertionError, match="differ beyond"):
        fp.compare(sim, reference, inputs)


# Under bfloat16 autocast (`fp.check_autocast`): the fixed programs' first NUM_AUTOCAST here, and the
# next SLOW_AUTOCAST in the slow tier (every dtype as the unsharded model's, nothing failing).
NUM_AUTOCAST, SLOW_AUTOCAST = 6, 94


def _assert_autocast_like_unsharded(seed: int) -> None:
    program = fp.random_program(seed)
    outcome = fp.check_autocast(program)
    assert outcome.status in ("pass", "value_error", "invalid"), (
        f"{outcome.status}: {outcome.kind}\n{outcome.message}\n\n{fp.source(program)}"
    )


@pytest.mark.parametrize("seed", range(NUM_AUTOCAST))
def test_fixed_program_under_autocast(seed):
    _assert_autocast_like_unsharded(seed)


@pytest.mark.slow
def test_more_programs_under_autocast():
    for seed in range(NUM_AUTOCAST, NUM_AUTOCAST + SLOW_AUTOCAST):
        _assert_autocast_like_unsharded(seed)


# The slow tier's shrinking: at most this long after the first failure, then a polish of the result.
SHRINK_SECONDS, POLISH_SECONDS = 90, 30
SHRINKING = fp.Shrinking(SHRINK_SECONDS)


@pytest.mark.slow
@settings(max_examples=400, derandomize=True, deadline=None, database=None,
          phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
@given(fp.programs())
def test_random_programs(program):
    outcome = SHRINKING.check(program)
    if outcome.status in fp.FAILING and current_build_context().is_final:
        program, outcome = fp.polish(program, outcome, POLISH_SECONDS)
    _assert_exact_or_refused(program, outcome)
