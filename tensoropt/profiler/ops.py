"""Per-op calibration: time the model's *unique* ops (after folding, never every layer) forward
and backward on this device, keyed by ``Op.key()``.

An op is replayed from the graph alone: its ATen overload, random tensors of its recorded shapes
and dtypes (integer inputs are zeros, masks all true, so indices stay valid), and its non-tensor
arguments parsed back from the recorded attributes in schema order. Ops that cannot be replayed,
or whose inputs exceed ``max_bytes``, are skipped and keep the roofline estimate.
"""

from __future__ import annotations

import ast
import math

import torch

from ..graph.ir import Op
from .device import timed

_SPECIAL = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _parse(text: str):
    if text in _SPECIAL:
        return _SPECIAL[text]
    if hasattr(torch, text) and isinstance(getattr(torch, text), torch.dtype):
        return getattr(torch, text)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _tensor(shape: tuple[int, ...], dtype_name: str, device: str) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def replay_args(op: Op, device: str):
    """(overload, args, kwargs) that run ``op`` on fresh tensors."""
    namespace, name, overload = op.target.split(".")
    func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    attrs = dict(op.attrs)
    tensors = [_tensor(m.shape, m.dtype, device) for m in op.inputs]
    schema = func._schema.arguments

    def required_after(k: int) -> int:
        return sum(1 for a in schema[k + 1:] if a.name not in attrs and str(a.type).startswith("Tensor")
                   and "?" not in str(a.type) and not str(a.type).endswith("[]"))

    args, kwargs, i = [], {}, 0
    for k, arg in enumerate(schema):
        kind = str(arg.type)
        if arg.name in attrs:                                   # a scalar where a tensor may go, too
            value = _parse(attrs[arg.name])
        elif kind.endswith("[]") and "Tensor" in kind:
            n = len(tensors) - i - required_after(k)
            value, i = tensors[i:i + n], i + n
        elif kind.startswith("Tensor?"):
            value = tensors[i] if len(tensors) - i > required_after(k) else None
            i += value is not None
        elif kind.startswith("Tensor"):
            value, i = tensors[i], i + 1
        elif arg.has_default_value():
            continue
        else:
            value = None
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    return func, args, kwargs


def time_op(op: Op, device: str, repeats: int, max_bytes: int) -> tuple[float, float] | None:
    """(forward_s, backward_s) of one op at its recorded shapes, or None if it cannot be replayed."""
    if op.bytes_read + op.bytes_written > max_bytes:
        return None
    try:
        func, args, kwargs = replay_args(op, device)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        fwd = timed(lambda: func(*args, **kwargs), device, repeats)
        if not op.requires_grad or not leaves:
            return fwd, 0.0
        return fwd, _backward_s(func, args, kwargs, leaves, device, repeats)
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
        return None


def _backward_s(func, args: list, kwargs: dict, leaves: list[torch.Tensor], device: str, repeats: int) -> float:
    """Seconds of the op's backward alone: ``autograd.grad`` through one recorded forward (kept by
    ``retain_graph``) with output gradients made once. Timing forward + backward and subtracting the
    forward would also time making those gradients and, from the second repeat on, accumulating
    every input's gradient into ``.grad``: work that is no part of the op's backward (on a CPU, for
    an op at batch 1, it can take longer than the backward itself)."""
    for leaf in leaves:
        leaf.requires_grad_(True)
    out = func(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
            if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        return 0.0
    grads = [torch.randn_like(o) for o in outs]
    return timed(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True), device,
                 repeats)


def calibration_ops(model: str) -> list[tuple[Op, str]]:
    """(op to time, key to store it under) for the folded model's unique ops (each block's template
    once plus the ops between blocks) and, for built-in transformers, the same ops at the shapes one
    of tp = 2, 4, 8 tensor-parallel ranks computes (stored as ``key@tpN`` where the shapes differ)."""
    from ..api import capture
    from ..graph.capture import trace_module
    from ..graph.fold import fold
    from ..models import resolve_model
    from ..models.sources import tensor_parallel_local

    def template_ops(folded):
        return [op for b in folded.blocks for op in b.ops] + list(folded.loose_ops)

    full = template_ops(fold(capture(model).graph))
    pairs = {op.key(): (op, op.key()) for op in full}
    source = resolve_model(model)
    for tp in (2, 4, 8):
        local_source = tensor_parallel_local(source, tp)
        if local_source is None:
            continue
        local = template_ops(fold(trace_module(*local_source.build(None, None), local_source.name)))
        if [op.target for op in local] != [op.target for op in full]:
            continue                                   # shapes changed the structure: nothing to align
        for whole, part in zip(full, local):
            if part.key() != whole.key():
                pairs.setdefault(f"{whole.key()}@tp{tp}", (part, f"{whole.key()}@tp{tp}"))
    return list(pairs.values())
