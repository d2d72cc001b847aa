"""What the commands of `tess-compile` share: the model factory, argument types, the
mesh, compile-option and cluster flags, the progress bar, the version, and the error that
prints one line and exits."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
import traceback

import torch
from torch import nn
from tqdm import tqdm

from tess_compile.core.cluster import Cluster
from tess_compile.core.options import AUTO, RENAMED, CompileOptions
from tess_compile.core.parallel_spec import ParallelSpec

__all__ = [
    "CliError",
    "KEEP_BLOCKS",
    "MODULE_NAME",
    "ProgressBar",
    "SEED",
    "add_model_arguments",
    "add_progress_flag",
    "build",
    "call_factory",
    "compile_options",
    "count_or_auto",
    "describe",
    "load_cluster_file",
    "load_factory",
    "non_negative",
    "on_off_auto",
    "package_version",
    "parse_target",
    "positive",
    "show_progress",
    "source_tree_version",
    "spec_of",
    "time_left",
    "type_names",
    "version_text",
]

SEED = 0  # torch's seed before every call of the factory


MODULE_NAME = "_tess_compile_factory"  # the name the factory's file is imported under

# --keep-blocks's words -> keep_blocks.
KEEP_BLOCKS = {AUTO: AUTO, "on": True, "off": False}


class CliError(Exception):
    """A failure reported as one message on stderr, without a traceback; `code` is the exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def parse_target(target: str) -> tuple[str, str]:
    """Split FILE.py:FACTORY and check that FILE is an existing .py file."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        example = f"{target}:make_model" if target.endswith(".py") else "model.py:make_model"
        raise CliError(f"expected FILE.py:FACTORY, got {target!r}: name the factory function "
                       f"after a colon, e.g. {example}")
    if not path.endswith(".py"):
        raise CliError(f"{path!r} is not a .py file: pass a Python file, e.g. model.py:{name}")
    if not os.path.isfile(path):
        raise CliError(f"file {path!r} not found (from {os.getcwd()}): check the path")
    return path, name


def load_factory(path: str, name: str):
    """Import the file at `path` and return its callable `name`."""
    full = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    sys.path.insert(0, os.path.dirname(full))  # so that the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # any error of the user's file
        raise CliError(f"importing {path} failed: {describe(exc, path)}; fix the error in the file") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(key for key, value in vars(module).items()
                       if callable(value) and getattr(value, "__module__", None) == MODULE_NAME)
        raise CliError(f"{path} has no function {name!r}; its callables are: {', '.join(found) or '(none)'}; "
                       f"pass one of them as FILE.py:FACTORY")
    return factory


def describe(exc: Exception, path: str) -> str:
    """The exception's last line, with the line of the file at `path` that raised it when known."""
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if isinstance(exc, SyntaxError):
        line = exc.lineno
    else:
        full = os.path.abspath(path)
        line = next((frame.lineno for frame in reversed(traceback.extract_tb(exc.__traceback__))
                     if frame.filename == full), None)
    return f"{text} (line {line})" if line else text


def build(path: str, name: str) -> tuple[nn.Module, object]:
    """Seed torch, call the factory and check that it returned (model, example_inputs)."""
    return call_factory(load_factory(path, name), path, name)


def call_factory(factory, path: str, name: str) -> tuple[nn.Module, object]:
    """Seed torch, call `factory` (`name` in `path`) and check that it returned (model, example_inputs)."""
    torch.manual_seed(SEED)
    try:
        result = factory()
    except Exception as exc:  # any error of the user's factory
        raise CliError(f"{name}() in {path} failed: {describe(exc, path)}; the factory must take "
                       "no arguments and return (model, example_inputs)") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
            and isinstance(result[1], (torch.Tensor, tuple, dict))):
        raise CliError(f"{name}() in {path} returned {type_names(result)}, not a pair (model, example_inputs): "
                       "return an nn.Module and a tensor, a tuple of positional inputs or a dict of "
                       "keyword inputs, e.g. `return model, torch.randn(4, 3, 8)`")
    return result


def type_names(value) -> str:
    """`value`'s type for a message; a tuple's element types too."""
    if isinstance(value, tuple):
        return f"tuple ({', '.join(type(item).__name__ for item in value)})"
    return type(value).__name__


def non_negative(text: str) -> float:
    """An argparse type: a float >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive(kind):
    """An argparse type: `kind` (int or float) that must be > 0."""
    def convert(text: str):
        problem = f"expected a number > 0 ({kind.__name__}), got {text!r}"
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(problem) from None
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(problem)
        return value
    return convert


def on_off_auto(text: str):
    """An argparse type: a word of `KEEP_BLOCKS` (auto, on, off) as its value ("auto", True, False)."""
    if text not in KEEP_BLOCKS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(KEEP_BLOCKS)}, got {text!r}")
    return KEEP_BLOCKS[text]


def count_or_auto(text: str):
    """A positive whole number, or "auto"."""
    if text == "auto":
        return text
    return positive(int)(text)


def add_model_arguments(parser: argparse.ArgumentParser, spec: bool = False) -> None:
    """What dump and run take: the factory, the mesh, a flag per field of `CompileOptions`
    (`--keep-blocks` for keep_blocks) with its choices, default and help, an old name
    (`RENAMED`) as a second spelling of the new one, and `--cluster`. A bool field that
    also takes auto is `--keep-blocks [auto|on|off]`, alone: on. With `spec`, `--spec FILE.json`
    (a `ParallelSpec`, `spec_of`) may stand for the mesh and the options."""
    parser.add_argument("target", metavar="FILE.py:FACTORY",
                        help="a function in FILE.py that takes no arguments and returns (model, example_inputs)")
    parser.add_argument("--q", type=int, required=not spec, help="mesh side: q*q*d ranks")
    parser.add_argument("--d", type=int, required=not spec, help="mesh depth, 1 <= d <= q (1d: any d)")
    if spec:
        parser.add_argument("--spec", metavar="FILE.json",
                            help="a parallel spec (tess-compile plan --pick, ParallelSpec.save): data-parallel "
                                 "replicas, ZeRO, pipeline stages and microbatches, the mesh and the compile options, "
                                 "in place of --q, --d and the option flags")
    old_names = {new: old for old, new in RENAMED.items()}
    for field in dataclasses.fields(CompileOptions):
        flags = [f"--{field.name.replace('_', '-')}"]
        if field.name in old_names:
            flags.append(f"--{old_names[field.name]}")
        help_text = field.metadata["help"]
        if AUTO in field.metadata.get("also", ()):
            words = {value: word for word, value in KEEP_BLOCKS.items()}
            parser.add_argument(*flags, dest=field.name, nargs="?", const=True, type=on_off_auto,
                                default=field.default, metavar="{" + ",".join(KEEP_BLOCKS) + "}",
                                help=f"{help_text} (alone: on; default {words[field.default]})")
        elif "choices" in field.metadata:
            parser.add_argument(*flags, dest=field.name, choices=field.metadata["choices"], default=field.default,
                                help=f"{help_text} (default {field.default})")
        elif field.default is None:
            parser.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(*flags, dest=field.name, action="store_true", help=help_text)
    parser.add_argument("--cluster", metavar="FILE.json",
                        help="a cluster file (Cluster.save, tess-compile profile -o) that prices the candidates of "
                             "auto options (default: the calibrated cluster)")


def load_cluster_file(path: str) -> Cluster:
    """The cluster of the JSON file at `path` (`--cluster`); a CliError if it holds none."""
    try:
        return Cluster.load(path)
    except ValueError as exc:
        raise CliError(f"{exc} (--cluster)") from None


def spec_of(args) -> ParallelSpec:
    """The `ParallelSpec` of parsed arguments: `--spec`'s file, or `--q`, `--d` and the option flags (one
    data-parallel replica, no pipeline); a CliError if both or neither are given."""
    if args.spec is None:
        if args.q is None or args.d is None:
            raise CliError("pass --q and --d (the mesh), or --spec FILE.json (a whole parallel layout)")
        return ParallelSpec(args.q, args.d, options=compile_options(args))
    flags = [f"--{name.replace('_', '-')}" for name in ("q", "d") if getattr(args, name) is not None]
    flags += [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(CompileOptions)
              if getattr(args, f.name) != f.default]
    if flags:
        raise CliError(f"--spec {args.spec} holds the mesh and the compile options: leave out {', '.join(flags)}, "
                       "or edit the spec")
    try:
        return ParallelSpec.load(args.spec)
    except ValueError as exc:
        raise CliError(f"{exc} (--spec)") from None


def compile_options(args) -> CompileOptions:
    """The `CompileOptions` of parsed arguments (see `add_model_arguments`), after a CliError with
    tess_compile's message unless [q, q, d] is a mesh of their mode."""
    options = CompileOptions(**{field.name: getattr(args, field.name) for field in dataclasses.fields(CompileOptions)})
    try:
        options.mesh(args.q, args.d)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return options


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """`--no-progress`: no progress bar (there is one on stderr only when stderr is a terminal)."""
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (one is drawn on stderr only when stderr is a terminal)")


def show_progress(args) -> bool:
    """Whether to draw a progress bar: stderr is a terminal and `--no-progress` was not given."""
    return not args.no_progress and sys.stderr.isatty()


class ProgressBar:
    """A tqdm bar on stderr fed by a library loop's `progress(done, total, what)` callback
    (`tess_compile.analysis.planner.Progress`), with the time left at the average pace so far:
    `tess-compile plan [######..............] 12/40 configurations, 00:21, ~30 s left, 2.5d [4, 4, 4], ...`.
    A context manager; the bar is erased at the end, as `tess_compile.check`'s is."""

    def __init__(self, command: str, unit: str):
        self.desc = f"tess-compile {command}"
        self.bar_format = "{desc} [{bar:20}] {n_fmt}/{total_fmt} " + unit + ", {elapsed}, {left}{postfix}"
        self.bar = None

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.bar is None:
            self.bar = _TimeLeftBar(total=total, desc=self.desc, bar_format=self.bar_format, file=sys.stderr,
                                    leave=False, ascii=True, smoothing=0, mininterval=0)
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.update(done - self.bar.n)  # draws (mininterval=0): the steps are seconds apart

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.bar is not None:
            self.bar.close()


class _TimeLeftBar(tqdm):
    """tqdm with a `{left}` field: "~30 s left" at the average time per step so far."""

    @property
    def format_dict(self) -> dict:
        values = super().format_dict
        done, total, elapsed = values["n"], values["total"], values["elapsed"]
        values["left"] = time_left(elapsed / done * (total - done)) if done else "estimating the time left"
        return values


def time_left(seconds: float) -> str:
    """"~30 s left", "~4 min left", "~1.5 h left"."""
    if seconds < 90:
        return f"~{seconds:.0f} s left"
    if seconds < 5400:
        return f"~{seconds / 60:.0f} min left"
    return f"~{seconds / 3600:.1f} h left"


def version_text() -> str:
    """What `tess-compile --version` prints: this package's version and torch's."""
    return f"tess-compile {package_version()} (torch {torch.__version__})"


def package_version() -> str:
    """The installed distribution's version; run from a source tree that is not installed,
    the version in its pyproject.toml, said so."""
    try:
        return importlib.metadata.version("tess-compile")
    except importlib.metadata.PackageNotFoundError:
        return source_tree_version(pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml")


def source_tree_version(pyproject: pathlib.Path) -> str:
    """The `version = "..."` of the pyproject.toml at `pyproject`, said to be a source tree's."""
    try:
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.MULTILINE)
    except OSError:
        found = None
    if found is None:
        return "(version unknown: not installed, and no pyproject.toml beside the package)"
    return f"{found.group(1)} (not installed: the source tree at {pyproject.parent})"
