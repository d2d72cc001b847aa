"""Stage 1, capture: an error the model's own code raises surfaces as that error, with its line.

torch.export runs the model on fake tensors; an op the model calls wrongly (a
`mean` of integers, a shape mismatch) fails inside it with torch's own error,
after torch's fake-tensor code has logged the whole failure at error level.
`the_models_own_errors` silences that log and, when export fails, runs a copy
of the model eagerly on the same inputs (torch's random state restored after):
if the unsharded model raises an error of the same type, that error is what
the caller gets, its message followed by the model's line
(`tess_compile.passes.source_lines.raised_at`); else export's own error stands.
Reads and writes no meta keys.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch

from tess_compile.passes.data_dependent import is_data_dependent
from tess_compile.passes.source_lines import raised_at, with_code

__all__ = ["the_models_own_errors"]

_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


class _MetaFailures(logging.Filter):
    """Drops fake-tensor's "failed while attempting to run meta" records: the error is raised anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def the_models_own_errors(model: torch.nn.Module, args: tuple, kwargs: dict):
    """Inside this block (an export of `model` on `args` and `kwargs`), see the module docstring."""
    quiet = _MetaFailures()
    _FAKE_TENSOR_LOG.addFilter(quiet)
    try:
        yield
    except Exception as err:
        if isinstance(err, ValueError) or is_data_dependent(err):
            raise  # ours, or explained by capture
        own = _eager_error(model, args, kwargs)
        if type(own) is not type(err):
            raise
        raise _with_line(own, model) from None
    finally:
        _FAKE_TENSOR_LOG.removeFilter(quiet)


def _eager_error(model: torch.nn.Module, args: tuple, kwargs: dict) -> Exception | None:
    """The error a copy of `model` raises when run eagerly on the inputs, or None."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            copy.deepcopy(model)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - the model's own error, whatever it is
            return err
    return None


def _with_line(err: Exception, model: torch.nn.Module) -> Exception:
    """`err` of its own type, its message followed by the model's line that raised it."""
    where = raised_at(err)
    line = (f"(raised by {type(model).__name__}'s own code at {with_code(where) if where else 'its forward'}: the "
            "unsharded model raises it too, on these inputs)")
    try:
        surfaced = type(err)(f"{err}\n{line}")
    except Exception:  # noqa: BLE001 - a type that takes other arguments: the note instead
        err.add_note(line)
        return err
    return surfaced.with_traceback(err.__traceback__)
