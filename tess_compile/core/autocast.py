"""Autocast as a mode of a compiled program, like train and eval.

A program is compiled for the autocast in force where it runs (`Program.autocast`: a device type
and dtype, or None): its graph holds the casts autocast would make (`tess_compile.passes.autocast_casts`),
so the runtimes run it with autocast off (`without_autocast`), and compile another program the
first time they are called under another autocast (`tess_compile.runtime.programs_by_mode`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils import _pytree as pytree

__all__ = ["Autocast", "autocast_off_everywhere", "autocast_state", "capture_device_type", "running_under",
           "without_autocast"]

# An enabled torch.autocast: (device type, dtype).
Autocast = tuple[str, torch.dtype]

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")


def autocast_state(device_type: str) -> Autocast | None:
    """The autocast in force in this thread for tensors of `device_type`; None where it is off (or
    the device type has no autocast: "meta")."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:  # a device type without autocast
        return None
    return device_type, torch.get_autocast_dtype(device_type)


def without_autocast(autocast: Autocast | None):
    """A context that turns off the autocast a program was compiled for (its casts are in its graph);
    a null context for a program compiled without autocast."""
    return contextlib.nullcontext() if autocast is None else torch.autocast(autocast[0], enabled=False)


def running_under(autocast: Autocast | None):
    """A context that turns `autocast` on (None: a null context)."""
    return contextlib.nullcontext() if autocast is None else torch.autocast(autocast[0], dtype=autocast[1])


@contextlib.contextmanager
def autocast_off_everywhere():
    """Autocast off for every device type: capture records the model's own dtypes."""
    with contextlib.ExitStack() as stack:
        for device_type in _DEVICE_TYPES:
            if autocast_state(device_type) is not None:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def capture_device_type(model: torch.nn.Module, example_inputs) -> str:
    """The device type a model is captured on: its first tensor input's, else its first parameter's."""
    for leaf in pytree.tree_leaves(example_inputs):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    for tensor in model.parameters():
        return tensor.device.type
    return "cpu"
