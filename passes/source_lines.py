"""The line of the model's own code that made a node of a captured graph, for messages.

torch.export records only the frames of `forward` methods, so a helper
function's op shows at the forward line that calls it. Library frames (torch, this
compiler's own, and Hugging Face's layers and helpers outside
`transformers/models/`) are skipped, unless there is no other.
"""

from __future__ import annotations

from pathlib import Path

from torch.fx import Node

__all__ = ["source_line"]


# The compiler's own packages: their frames (capture calling the model) are never the model's.
_OWN = tuple(str(Path(__file__).resolve().parent.parent / package) for package in ("passes", "tess_compile"))


def _is_own(path: str) -> bool:
    return str(Path(path).resolve()).startswith(_OWN)


def _is_library(path: str) -> bool:
    """Code of torch, of this compiler, or of Hugging Face's layers and helpers outside `transformers/models/`."""
    if _is_own(path):
        return True
    path = path.replace("\\", "/")
    return "/torch/" in path or ("/transformers/" in path and "/transformers/models/" not in path)


def _model_frame(node: Node) -> tuple[str, int] | None:
    """(file, line) of the innermost model code that made `node`, from its stack trace.

    torch.export records only the frames of `forward` methods, so a helper
    function's op shows at the forward line that calls it. Library frames
    are skipped, unless there is no other (a model defined inside torch);
    the compiler's own frames always are.
    """
    frames = []
    for line in (node.meta.get("stack_trace") or "").splitlines():
        line = line.strip()
        if line.startswith("File "):
            path, _, rest = line[len("File ") :].partition(", line ")
            frames.append((path.strip('"'), int(rest.split(",")[0])))
    model = [frame for frame in frames if not _is_library(frame[0])]
    outside = [frame for frame in frames if not _is_own(frame[0])]
    return (model or outside or frames)[-1] if frames else None


def source_line(node: Node) -> str:
    """`file:line` of the model code that made `node`, or its name."""
    frame = _model_frame(node)
    return f"{frame[0]}:{frame[1]}" if frame else f"node {node.name}"
