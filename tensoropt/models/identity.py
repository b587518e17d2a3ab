"""What a built module's capture is cached under (``api.capture``, ``graph.cache``): everything that decides the
graph its forward traces, so that a model changed in any of it is traced again."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_PLAIN = (bool, int, float, str, type(None))


def module_identity(model: nn.Module, inputs: tuple | Mapping) -> dict[str, Any]:
    """A structural description of a built module: its module tree, state shapes, input shapes, the source code of
    every non-torch module class (so an edited forward invalidates the cache), and every module's settings
    (``module_settings``: a nanoGPT attention's ``n_head`` shapes its graph without showing in any of the rest)."""
    values = inputs.items() if isinstance(inputs, Mapping) else enumerate(inputs)
    classes = {}
    for mod in model.modules():
        cls = type(mod)
        if not cls.__module__.startswith("torch.") and cls.__qualname__ not in classes:
            try:
                classes[cls.__qualname__] = inspect.getsource(cls)
            except (OSError, TypeError):
                classes[cls.__qualname__] = cls.__module__
    return {
        "repr": repr(model),
        "state": [[n, list(t.shape), str(t.dtype)] for n, t in model.state_dict(keep_vars=True).items()],
        "inputs": [[str(k), list(v.shape), str(v.dtype)] if isinstance(v, torch.Tensor) else [str(k), repr(v)]
                   for k, v in values],
        "classes": classes,
        "settings": module_settings(model),
    }


def module_settings(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per module (by path), its public attributes that are plain values (numbers, strings, flags and sequences of
    them: head counts, dropout rates, ``is_causal``, ``training``), functions (an activation passed in) or configs (a
    dataclass, or an object with ``to_dict``, as Hugging Face's), which a forward may read to decide what it
    computes."""
    configs: dict[int, Any] = {}           # one config object is shared by many modules: described once
    out = {}
    for path, mod in model.named_modules():
        mine = {}
        for name, value in vars(mod).items():
            if name.startswith("_"):
                continue
            described = _described(value, configs)
            if described is not None:
                mine[name] = described
        if mine:
            out[path] = mine
    return out


def _described(value: Any, configs: dict[int, Any]) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return list(value)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        # a function the forward calls (an activation passed in as ``F.gelu``): by its name
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, functools.partial):
        return f"partial({_described(value.func, configs)}, {value.args!r}, {value.keywords!r})"
    if id(value) not in configs:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            configs[id(value)] = repr(dataclasses.asdict(value))
        elif callable(getattr(value, "to_dict", None)) and not isinstance(value, (nn.Module, torch.Tensor)):
            try:
                configs[id(value)] = repr(sorted(value.to_dict().items(), key=lambda kv: str(kv[0])))
            except Exception:            # a config that cannot describe itself adds nothing; its modules still do
                configs[id(value)] = None
        else:
            return None
    return configs[id(value)]
