"""Float64 all the way: a model's own casts down to float32 keep float64, for `check` and the zoo.

The face, beside `validation.py`. Llama's and Qwen's RMSNorm (`.to(torch.float32)`),
their rotary tables (`.float()`), softmaxes with `dtype=torch.float32` and Hugging
Face's loss (`logits.float()`) compute in float32 even in a float64 model, so a
comparison with the unsharded model would have float32's rounding as its floor
(1e-5) and a miscompile of 1e-6 would pass. `keeping_float64(*models)` runs each
model's forward under `KeepFloat64`, a TorchFunctionMode that turns every request
for a less precise floating dtype into one for float64 (complex64 into
complex128): `.float()`, `.half()` and `.bfloat16()` become `.double()`, a dtype
given to `Tensor.to` or `Tensor.type`, and any `dtype=` argument. It acts at the
Python level, so the oracle's run and the capture of the sharded copy (torch.export
traces the forward under it) see the same float64 program. `kept` says which
requests it changed, by kind and the model's source line. A cast the model asks
for copies its input (`.float()` of a float64 slice is a new, contiguous tensor),
so a kept cast copies too, where the model's would have. A reinterpretation of
bits (`view(dtype)`) is left as it is. The models must be copies: their forward is
an instance attribute inside the block, removed after it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tess_compile.passes.source_lines import called_from

__all__ = ["KeepFloat64", "keeping_float64"]

# A less precise dtype that a model asks for -> what it gets instead.
WIDER = {torch.float32: torch.float64, torch.float16: torch.float64, torch.bfloat16: torch.float64,
         torch.complex64: torch.complex128, torch.complex32: torch.complex128}
# `.float()` and kin -> (what the report calls it, the dtype the model asks for).
_TO_DOUBLE = {torch.Tensor.float: (".float()", torch.float32), torch.Tensor.half: (".half()", torch.float16),
              torch.Tensor.bfloat16: (".bfloat16()", torch.bfloat16)}
_POSITIONAL_DTYPE = {torch.Tensor.to: ".to", torch.Tensor.type: ".type"}
_REINTERPRETS = (torch.Tensor.view,)  # x.view(dtype) reads the same bits as another dtype


class KeepFloat64(TorchFunctionMode):
    """Requests for a less precise floating dtype get float64 (`WIDER`). `kept`: `{"what at file:line":
    count}` of the requests it changed, in the order first seen."""

    def __init__(self):
        super().__init__()
        self.kept: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _TO_DOUBLE:  # x.float(): x.to(float64), a copy where the model's cast would make one
            what, wanted = _TO_DOUBLE[func]
            self._note(what)
            return torch.Tensor.to(args[0], WIDER[wanted], copy=args[0].dtype != wanted, **kwargs)
        wanted = None
        if func in _POSITIONAL_DTYPE and any(arg in WIDER for arg in args[1:]):
            wanted = next(arg for arg in args[1:] if arg in WIDER)
            self._note(f"{_POSITIONAL_DTYPE[func]}({wanted})")
            args = tuple(WIDER.get(arg, arg) if isinstance(arg, torch.dtype) else arg for arg in args)
        elif kwargs.get("dtype") in WIDER and func not in _REINTERPRETS:
            wanted = kwargs["dtype"]
            self._note(f"{_name(func)}(dtype={wanted})")
            kwargs["dtype"] = WIDER[wanted]
        if func in _POSITIONAL_DTYPE and wanted is not None and args[0].dtype != wanted:
            func, kwargs["copy"] = torch.Tensor.to, True  # the model's cast copies (contiguous if not dense)
        return func(*args, **kwargs)

    def _note(self, what: str) -> None:
        key = f"{what} at {called_from() or 'the model'}"
        self.kept[key] = self.kept.get(key, 0) + 1


def _name(func) -> str:
    name = getattr(func, "__name__", str(func))
    return f".{name}" if getattr(torch.Tensor, name, None) is func else name


@contextlib.contextmanager
def keeping_float64(*models: nn.Module) -> Iterator[KeepFloat64]:
    """Within the block, each model's forward runs under one `KeepFloat64` mode, which it yields."""
    mode = KeepFloat64()
    owns = [model.__dict__.get("forward") for model in models]
    for model in models:
        model.forward = _under(mode, model.forward)
    try:
        yield mode
    finally:
        for model, own in zip(models, owns):
            if own is None:
                del model.forward
            else:
                model.forward = own


def _under(mode: KeepFloat64, forward):
    @functools.wraps(forward)
    def forward_in_float64(*args, **kwargs):
        with mode:
            return forward(*args, **kwargs)

    return forward_in_float64
