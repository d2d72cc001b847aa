"""The compile options: one definition that every entry point's keywords come from.

`CompileOptions` is a frozen dataclass of the options that change the
per-rank program: the parallel mode, the schedule of the matrix products,
what backward keeps or recomputes, and how strict and how checked the
compile is. `shard`, `simulate`, `dump`, `pipeline_stage`,
`simulate_pipeline`, the torch.compile backend and the command line take
exactly these keywords (`takes_compile_options` builds their signatures
from the fields; the command line builds its flags from them), so no copy
can drift. Each field's metadata holds its choices and help text.

`summa` also takes "auto", the default: each matrix product takes the schedule
priced cheapest for it on a cluster (`tess_compile.passes.product_schedule`; `cluster=` of
`shard`, `simulate`, `dump`, the backend and `compile_model`, by default
`CALIBRATED_CLUSTER`). `keep_blocks` takes "auto" too: `shard`, `simulate`,
`dump` and the backend compile with and without keeping the fetched blocks and
take the faster that fits the cluster's memory
(`tess_compile.analysis.schedule_choice`); a compile itself
(`tess_compile.passes.driver.compile_model`) takes True or False.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import warnings
from dataclasses import dataclass, field

import torch

from tess_compile.core.mesh import MODES, Mesh, check_mode

__all__ = ["AUTO", "BATCH_SPLITS", "CONTEXT_SCHEDULES", "CompileOptions", "RECOMPUTE", "RENAMED", "SCHEDULES",
           "TOKEN_ORDERS", "TOKEN_SPLITS", "renamed", "takes_compile_options"]

# How the q steps of a matrix product run: "broadcast" one after another (the papers'
# algorithms); "overlap": step t+1's broadcasts in flight while step t multiplies;
# "gather": one all-gather of each operand and one product. The names of the records of
# `tess_compile.passes.summa.SCHEDULE_TABLE` (their lowering and price), in its order: summa checks it.
SCHEDULES = ("broadcast", "overlap", "gather")
# `summa` besides the schedules: each product's cheapest on a cluster (`tess_compile.passes.product_schedule`);
# `keep_blocks` besides True and False: the faster program that fits the cluster's memory
# (`tess_compile.analysis.schedule_choice`).
AUTO = "auto"
# What backward recomputes instead of saving: nothing, each repeated block, or runs of
# cheap local ops (besides the model's own torch.utils.checkpoint regions).
RECOMPUTE = ("none", "blocks", "selective")
# How the inputs' batch splits in 2.5-D: over depth and row, over depth alone, or not at
# all; "auto" (the default): the first of these that divides the example batch.
BATCH_SPLITS = ("depth_row", "depth", "none")
# The axes that split each sequence's tokens (`tess_compile.core.row_split`): none, row, depth and row (2.5-D,
# 2-D, 3-D: the axes the batch leaves), or col (1-D: Megatron-LM's sequence parallelism); "auto" (the
# default): the widest that the batch leaves and the example's tokens divide.
TOKEN_SPLITS = ("none", "row", "depth_row", "col")
# How attention over a token split meets the other ranks' keys (`tess_compile.ops.context_attention`,
# `tess_compile.ops.ring_attention`): all of them at once (all-gathered, Llama 3's context parallelism), or
# one block at a time, partial softmaxes merged by their log-sum-exp (the ring schedule).
CONTEXT_SCHEDULES = ("gather", "ring")
# Which tokens of a split sequence each rank holds (`tess_compile.core.row_split`): one contiguous block, or
# stripes (a block from each of several equal parts of the sequence, so that causal attention's work is
# even over the ranks); "auto" (the default): striped where it pays (causal attention, no op that reads
# neighbouring tokens of activations, no output that holds the tokens, the gather schedule).
TOKEN_ORDERS = ("contiguous", "striped")
# Old keyword -> the option it names now (accepted with a FutureWarning).
RENAMED = {"checkpoint": "recompute"}


def _debug_env() -> bool:
    return os.environ.get("TESS_COMPILE_DEBUG", "") not in ("", "0")


@dataclass(frozen=True)
class CompileOptions:
    """The options of a compile; see the module docstring and docs/modes.md, docs/memory.md."""

    mode: str = field(default="2.5d", metadata={
        "choices": MODES, "check": check_mode,
        "help": "2.5d (Tesseract, the default), 2d (Optimus, d=1), 3d (d=q), or 1d (Megatron-LM over q*q*d ranks)"})
    summa: str = field(default=AUTO, metadata={
        "choices": (*SCHEDULES, AUTO), "what": "a schedule",
        "help": "schedule of the matrix products: auto (the default: each product's cheapest on the cluster), "
                "broadcast (the papers' q steps), overlap (the next step's broadcasts in flight) or gather (one "
                "all-gather per operand)"})
    keep_blocks: bool | str = field(default=False, metadata={
        "also": (AUTO,),
        "help": "keep the fetched blocks of the matrix products for backward (less communication, q times the "
                "saved bytes) instead of fetching them again; auto: price both on the cluster and keep them where "
                "that is faster and fits its memory"})
    recompute: str = field(default="none", metadata={
        "choices": RECOMPUTE, "what": "a recompute option",
        "help": "recompute in backward instead of saving: none (the default), blocks (each repeated block) or "
                "selective (runs of cheap local ops)"})
    batch_split: str = field(default=AUTO, metadata={
        "choices": (*BATCH_SPLITS, AUTO), "what": "a batch split",
        "help": "how the inputs' batch splits in 2.5-D: depth_row (over depth and row), depth (over depth alone), "
                "none, or auto (the default: the first that divides the example batch); a batch whole over row "
                "runs the matrix products weight-stationary, moving the rows, not the weights (docs/modes.md)"})
    token_split: str = field(default=AUTO, metadata={
        "choices": (*TOKEN_SPLITS, AUTO), "what": "a token split",
        "help": "how each sequence's tokens split: over row or depth_row (2.5-D: the axes the batch leaves whole; "
                "context-parallel attention), over col (1-D: sequence parallelism), none, or auto (the default: the "
                "widest the batch leaves and the example's tokens divide; none in a dynamic compile) "
                "(docs/modes.md)"})
    token_order: str = field(default=AUTO, metadata={
        "choices": (*TOKEN_ORDERS, AUTO), "what": "a token order",
        "help": "which tokens of a split sequence a rank holds: contiguous (one block) or striped (a block of each "
                "of several equal parts of the sequence: causal attention's work even over the ranks, which then "
                "skip the keys no query of a part can see); auto (the default): striped where the model has causal "
                "attention, no op that reads neighbouring tokens of its activations and no output that holds "
                "the tokens (docs/modes.md)"})
    context: str = field(default="gather", metadata={
        "choices": CONTEXT_SCHEDULES, "what": "a context schedule",
        "help": "attention over a token split: gather (the default: the keys and values of the token axes "
                "all-gathered, Llama 3's context parallelism) or ring (one block of keys and values at a time, "
                "merged by log-sum-exp: less memory, more collectives) (docs/modes.md)"})
    dynamic: bool = field(default=False, metadata={
        "help": "one program for every batch and sequence length: capture the inputs' batch (a multiple of the "
                "ranks that split it) and their other dims that no weight fixes as symbols (docs/dynamic.md)"})
    strict: bool = field(default=False, metadata={"help": "fail on ops that would run replicated"})
    verify: bool | None = field(default=None, metadata={
        "also": (None,),
        "help": "check the placed graph too (default: when TESS_COMPILE_DEBUG=1; the per-rank graph is always checked)"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if "check" in f.metadata:
                f.metadata["check"](value)
            elif choices is not None and value not in choices:
                raise ValueError(f"{f.name}={value!r} is not {f.metadata['what']}: use one of "
                                 f"{', '.join(map(repr, choices))} ({f.metadata['help']})")
            also = f.metadata.get("also", ())  # values a bool field takes besides True and False
            if choices is None and not isinstance(value, bool) and value not in also:
                values = ["True", "False", *map(repr, also)]
                raise ValueError(f"{f.name}={value!r} is not a bool{''.join(f' or {v!r}' for v in also)}: pass "
                                 f"{f.name}={', '.join(values[:-1])} or {values[-1]}")

    @property
    def checked(self) -> bool:
        """Whether the placed graph is verified too (`verify`, else TESS_COMPILE_DEBUG=1)."""
        return _debug_env() if self.verify is None else self.verify

    def mesh(self, q: int, d: int) -> Mesh:
        """The `[q, q, d]` mesh in this options' mode (ValueError for a mesh the mode does not fit)."""
        return Mesh(q, d, self.mode)

    @classmethod
    def resolve(cls, where: str, options: CompileOptions | None = None, keywords: dict | None = None,
                mode: str | None = None) -> CompileOptions:
        """The options of a call of `where`: `options`, or the option `keywords` (not both).
        An old keyword name (`RENAMED`) is taken with a FutureWarning; an unknown one is a
        TypeError, as Python's. `mode` (a mesh's) is the mode, unless the options say another."""
        keywords = renamed(where, keywords or {}, stacklevel=4)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in keywords if key not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}{hint}; its compile "
                            f"options are {', '.join(names)}")
        if options is not None:
            if keywords:
                raise TypeError(f"{where}() got options= and the option keywords {sorted(keywords)}: pass one of them")
            if not isinstance(options, cls):
                raise TypeError(f"{where}(options={options!r}): pass a tess_compile.CompileOptions")
        else:
            options = cls(**keywords) if mode is None or "mode" in keywords else cls(mode=mode, **keywords)
        if mode is not None and options.mode != mode:
            raise ValueError(f"{where}() got options of mode {options.mode!r} for a mesh of mode {mode!r}: "
                             "give the mesh and the options one mode")
        return options


def renamed(where: str, keywords: dict, stacklevel: int = 3) -> dict:
    """`keywords` with the old names of `RENAMED` replaced by the new ones, each with a FutureWarning
    (a TypeError if both are given) that points `stacklevel` frames up (3: the caller's caller)."""
    keywords = dict(keywords)
    for old, new in RENAMED.items():
        if old in keywords:
            if new in keywords:
                raise TypeError(f"{where}() got both {old}= and {new}=: pass {new}= only")
            warnings.warn(f"{where}({old}=...) is deprecated: pass {new}= instead", FutureWarning,
                          stacklevel=stacklevel)
            keywords[new] = keywords.pop(old)
    return keywords


# A face's first parameter that takes the model: one module, or a list of stages.
_MODULE_PARAMETERS = {"model": False, "module": False, "stages": True}


def _check_modules(where: str, name: str, value) -> None:
    """A ValueError unless `value` is an nn.Module (for "stages": a list of them)."""
    values = value if _MODULE_PARAMETERS[name] and isinstance(value, (list, tuple)) else [value]
    wrong = next((v for v in values if not isinstance(v, torch.nn.Module)), None)
    if wrong is None and values:
        return
    got = "nothing" if wrong is None else f"a {type(wrong).__module__}.{type(wrong).__qualname__}"
    raise ValueError(
        f"{where}({name}=...): got {got}, and it takes "
        + ("a list of torch.nn.Module stages" if _MODULE_PARAMETERS[name] else "a torch.nn.Module")
        + ": pass the model itself (a function f: wrap it as a module, `class F(torch.nn.Module): "
        "def forward(self, x): return f(x)`)")


def takes_compile_options(function):
    """`function(..., options: CompileOptions)` called with the options as keywords (`mode=`,
    `summa=`, ...), or as `options=`: its signature shows the fields in place of `options`."""
    where = f"tess_compile.{function.__name__}"
    signature = inspect.signature(function)
    own = set(signature.parameters) - {"options"}

    first = next(iter(signature.parameters))

    @functools.wraps(function)
    def with_options(*args, options: CompileOptions | None = None, **keywords):
        # the function's own keywords go to it; the rest are options (an unknown one gets
        # CompileOptions' TypeError, with the option names and a close match)
        if first in _MODULE_PARAMETERS:
            _check_modules(where, first, args[0] if args else keywords.get(first))
        given = {key: keywords.pop(key) for key in list(keywords) if key not in own}
        return function(*args, options=CompileOptions.resolve(where, options, given), **keywords)

    parameters = list(signature.parameters.values())
    position = [p.name for p in parameters].index("options")  # the fields stand where `options` does
    del parameters[position]
    option_parameters = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                           annotation=f.type) for f in dataclasses.fields(CompileOptions)]
    option_parameters.append(inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None,
                                               annotation="CompileOptions | None"))
    with_options.__signature__ = signature.replace(
        parameters=parameters[:position] + option_parameters + parameters[position:])
    return with_options
