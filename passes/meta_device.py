"""Stage 1, capture: a model built on the meta device, its buffers recomputed, captured on that device.

A model built under `torch.device("meta")` holds no values, and a checkpoint
gives its parameters and persistent buffers. Its non-persistent buffers (a
rotary embedding's `inv_freq`, position tables, RoPE caches) are computed at
init and never saved, so no checkpoint holds them. `recompute_meta_buffers`
recomputes each from the code of the module that owns it, on the CPU, at its
size, and puts it in the model in place of the meta tensor (as torchtitan's
own `init_weights(buffer_device=...)` does after `to_empty`), saying so once:

- a module with torchtitan's `_init_self_buffers(buffer_device=...)` runs it;
- a module with a `config` and no parameters (transformers' rotary
  embeddings) is built again from that config on the CPU and gives its buffers;
- a module with `init_weights(buffer_device=...)` (torchtitan's models), all
  of whose tensors are on the meta device, runs it (its weights' init on the
  meta device does nothing).

A buffer none of these gives at its shape stays on the meta device: analyses
(dump, plan) need no values, and a runtime refuses it by name
(`tess_compile.runtime.state.add_local_tensors`).

Such a model runs on one device, where its weights are loaded, so it is
captured on one device: `on_the_meta_device` gives export the example inputs
and the model's tensors that hold values (the recomputed buffers) as meta
tensors of their shapes (only shapes and dtypes matter to a capture), and
puts the model's own back after. Token ids on the CPU, float inputs that meet
a weight, buffers recomputed on the CPU: all capture alike. Reads and writes
no meta keys.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["on_the_meta_device", "recompute_meta_buffers"]

log = logging.getLogger("tess_compile")

_CPU, _META = torch.device("cpu"), torch.device("meta")


def recompute_meta_buffers(model: nn.Module) -> list[str]:
    """Recompute the meta-device non-persistent buffers of `model` (see the module docstring);
    returns the names of those that stay on the meta device."""
    owners = _owners_of_meta_buffers(model)
    if not owners:
        return []
    recomputed: dict[str, list[str]] = {}  # how -> names
    left = []
    for path, module in owners.items():
        metas = {name: module._buffers[name] for name in _meta_buffer_names(module)}
        how, values = _recompute(module, metas)
        for name, meta in metas.items():
            full = f"{path}.{name}" if path else name
            if name in values:
                _replace(model, meta, values[name])
                recomputed.setdefault(how, []).append(full)
            else:
                left.append(full)
    if recomputed:
        log.warning("%s is on the meta device: its non-persistent buffers, which no checkpoint holds, were "
                    "recomputed on the CPU by the code of the modules that own them: %s", type(model).__name__,
                    "; ".join(f"{_some(names)} by {how}" for how, names in recomputed.items()))
    return left


def _some(names: list[str]) -> str:
    """The first names, and how many more."""
    shown = ", ".join(names[:2])
    return shown if len(names) <= 2 else f"{shown} and {len(names) - 2} more"


def _owners_of_meta_buffers(model: nn.Module) -> dict[str, nn.Module]:
    """Each module (by its dotted path) that holds a non-persistent buffer on the meta device."""
    return {path: module for path, module in model.named_modules() if _meta_buffer_names(module)}


def _meta_buffer_names(module: nn.Module) -> list[str]:
    return [name for name, buf in module._buffers.items()
            if buf is not None and buf.is_meta and name in module._non_persistent_buffers_set]


def _recompute(module: nn.Module, metas: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    """How the buffers `metas` (name -> meta tensor) of `module` were recomputed, and the values of those
    that came out at their shape; the module's own buffers are left as they were."""
    for how, compute in _WAYS:
        saved = dict(module._buffers)
        try:
            values = compute(module)
        except Exception as err:  # the module's own code failed: try the next way, else refuse the buffer later
            log.debug("%s: %s failed: %s", type(module).__name__, how, err)
            values = None
        finally:
            module._buffers.update(saved)
        fitting = {name: _like(values[name], meta) for name, meta in metas.items()
                   if values is not None and isinstance(values.get(name), torch.Tensor)
                   and values[name].shape == meta.shape}
        if fitting:
            return how.format(type(module).__name__), fitting
    return "", {}


def _like(value: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """`value` on the CPU in the dtype the model holds (a model cast after it was built casts its buffers)."""
    return value.detach().to(device=_CPU, dtype=meta.dtype)


def _by_own_buffer_code(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """torchtitan's modules: `_init_self_buffers` sets this module's own buffers on a device."""
    init = getattr(module, "_init_self_buffers", None)
    if not callable(init):
        return None
    init(buffer_device=_CPU)
    return dict(module._buffers)


def _by_config(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """transformers' modules: the module built again from its `config`, on the CPU (one without
    parameters, so that nothing of a weight's size is allocated)."""
    config = getattr(module, "config", None)
    first = list(inspect.signature(type(module).__init__).parameters)[1:2]
    if config is None or first != ["config"] or next(module.parameters(), None) is not None:
        return None
    with torch.device(_CPU):
        return dict(type(module)(config)._buffers)


def _by_init_weights(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """torchtitan's models: `init_weights(buffer_device=...)`, when every tensor of the module is on the
    meta device (its parameters' init does nothing there)."""
    init = getattr(module, "init_weights", None)
    takes = callable(init) and "buffer_device" in inspect.signature(init).parameters
    if not takes or not all(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return None
    init(buffer_device=_CPU)
    return dict(module._buffers)


_WAYS = (
    ("{}._init_self_buffers", _by_own_buffer_code),
    ("{} rebuilt from its config", _by_config),
    ("{}.init_weights", _by_init_weights),
)


def _replace(model: nn.Module, meta: torch.Tensor, value: torch.Tensor) -> None:
    """Put `value` in the place of the buffer `meta` in every module that holds it (a shared buffer)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is meta:
                module._buffers[name] = value


@contextlib.contextmanager
def on_the_meta_device(model: nn.Module, args: tuple, kwargs: dict):
    """Yield `(args, kwargs)` to export `model` with: as they are if no tensor of the model is on the meta
    device; else every tensor among them, and every parameter and buffer of the model that is not on the
    meta device, a meta tensor of its shape (see the module docstring), the model's own put back after."""
    held = [(table, name, t) for module in model.modules()
            for table in (module._parameters, module._buffers) for name, t in table.items() if t is not None]
    if not any(t.is_meta for *_, t in held):
        yield args, kwargs
        return
    metas: dict[int, torch.Tensor] = {}  # one meta tensor for each tensor: shared and tied ones stay so
    for table, name, t in held:
        if not t.is_meta:
            table[name] = metas.setdefault(id(t), _meta_like(t))
    try:
        yield pytree.tree_map_only(torch.Tensor, _meta_like, (args, kwargs))
    finally:
        for table, name, t in held:
            table[name] = t


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta.requires_grad_(t.requires_grad)
