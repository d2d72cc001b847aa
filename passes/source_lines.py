"""The line of the model's own code that made a node of a captured graph, or raised an error, for messages.

torch.export records only the frames of `forward` methods, so a helper
function's op shows at the forward line that calls it. Library frames (torch, this
compiler's own, Hugging Face's layers and helpers outside `transformers/models/`,
and generated code such as `<string>`) are skipped, unless there is no other.
An error's traceback holds every frame, helpers' too: `raised_at` reads the
frames below the compiler's own (capture calling the model); `called_from` reads
the stack of a call in progress.
"""

from __future__ import annotations

import linecache
import traceback
from pathlib import Path
from typing import NamedTuple

from torch.fx import Node

__all__ = ["called_from", "raised_at", "source_line", "with_code"]


class _Frame(NamedTuple):
    path: str
    line: int
    function: str


# The compiler's own packages: their frames (capture calling the model) are never the model's.
_OWN = tuple(str(Path(__file__).resolve().parent.parent / package) for package in ("passes", "tess_compile"))


def _is_own(path: str) -> bool:
    return str(Path(path).resolve()).startswith(_OWN)


def _is_library(path: str) -> bool:
    """Code of torch, of this compiler, of Hugging Face's layers and helpers outside `transformers/models/`,
    or generated code (`<string>`, fx's `<eval_with_key>`), which has no source line to show."""
    if path.startswith("<") or _is_own(path):
        return True
    path = path.replace("\\", "/")
    return "/torch/" in path or ("/transformers/" in path and "/transformers/models/" not in path)


def _innermost_model_frame(frames: list[_Frame]) -> _Frame | None:
    """The innermost frame of model code; else (a model defined inside torch) the innermost `forward`
    outside the compiler, else the innermost frame outside it; the compiler's own frames never."""
    model = [frame for frame in frames if not _is_library(frame.path)]
    outside = [frame for frame in frames if not _is_own(frame.path)]
    forwards = [frame for frame in outside if frame.function == "forward"]
    for candidates in (model, forwards, outside, frames):
        if candidates:
            return candidates[-1]
    return None


def _model_frame(node: Node) -> _Frame | None:
    """The innermost model code that made `node`, from its stack trace."""
    frames = []
    for line in (node.meta.get("stack_trace") or "").splitlines():
        line = line.strip()
        if line.startswith("File "):
            path, _, rest = line[len("File ") :].partition(", line ")
            number, _, function = rest.partition(", in ")
            frames.append(_Frame(path.strip('"'), int(number), function.strip()))
    return _innermost_model_frame(frames)


def source_line(node: Node) -> str:
    """`file:line` of the model code that made `node`, or its name."""
    frame = _model_frame(node)
    return f"{frame.path}:{frame.line}" if frame else f"node {node.name}"


def with_code(where: str) -> str:
    """`file:line` as `source_line` gives it, followed by that line's code where the file is readable."""
    path, _, number = where.rpartition(":")
    code = linecache.getline(path, int(number)).strip() if number.isdigit() else ""
    return f"{where} (`{code}`)" if code else where


def raised_at(err: BaseException) -> str | None:
    """`file:line` of the model code where `err` was raised: the innermost model frame of its traceback
    below the compiler's last frame (the model as capture called it), or None without such frames."""
    frames = [_Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(err.__traceback__)]
    last_own = max((i for i, frame in enumerate(frames) if _is_own(frame.path)), default=-1)
    frame = _innermost_model_frame(frames[last_own + 1 :])
    return f"{frame.path}:{frame.line}" if frame else None


def called_from() -> str | None:
    """`file:line` of the model code that is calling now (for a TorchFunctionMode of ours: the
    innermost model frame between the compiler's frames that called the model and its own), or None."""
    frames = [_Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack()]
    while frames and _is_own(frames[-1].path):
        frames.pop()
    last_own = max((i for i, frame in enumerate(frames) if _is_own(frame.path)), default=-1)
    frame = _innermost_model_frame(frames[last_own + 1 :])
    return f"{frame.path}:{frame.line}" if frame else None
