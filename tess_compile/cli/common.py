"""What the commands of `tess-compile` share: the model factory, argument types, the
mesh, compile-option and cluster flags, and the error that prints one line and exits."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import traceback

import torch
from torch import nn

from tess_compile.core.cluster import Cluster
from tess_compile.core.options import AUTO, RENAMED, CompileOptions

__all__ = [
    "CliError",
    "KEEP_BLOCKS",
    "MODULE_NAME",
    "SEED",
    "add_model_arguments",
    "build",
    "call_factory",
    "compile_options",
    "count_or_auto",
    "describe",
    "load_cluster_file",
    "load_factory",
    "non_negative",
    "on_off_auto",
    "parse_target",
    "positive",
    "type_names",
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What dump and run take: the factory, the mesh, a flag per field of `CompileOptions`
    (`--keep-blocks` for keep_blocks) with its choices, default and help, an old name
    (`RENAMED`) as a second spelling of the new one, and `--cluster`. A bool field that
    also takes auto is `--keep-blocks [auto|on|off]`, alone: on."""
    parser.add_argument("target", metavar="FILE.py:FACTORY",
                        help="a function in FILE.py that takes no arguments and returns (model, example_inputs)")
    parser.add_argument("--q", type=int, required=True, help="mesh side: q*q*d ranks")
    parser.add_argument("--d", type=int, required=True, help="mesh depth, 1 <= d <= q (1d: any d)")
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


def compile_options(args) -> CompileOptions:
    """The `CompileOptions` of parsed arguments (see `add_model_arguments`), after a CliError with
    tess_compile's message unless [q, q, d] is a mesh of their mode."""
    options = CompileOptions(**{field.name: getattr(args, field.name) for field in dataclasses.fields(CompileOptions)})
    try:
        options.mesh(args.q, args.d)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return options
