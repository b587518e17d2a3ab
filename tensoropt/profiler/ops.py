"""Per-op calibration: time the model's *unique* ops (after folding, never every layer) forward
and backward on this device, keyed by ``Op.key()``.

An op is replayed from the graph alone: its ATen overload, random tensors of its recorded shapes
and dtypes (integer inputs are zeros, masks all true, so indices stay valid), and its non-tensor
arguments parsed back from the recorded attributes in schema order. Ops that cannot be replayed,
or whose inputs exceed ``max_bytes``, are skipped and keep the roofline estimate.

An op is timed at ``CALIBRATION_SAMPLES`` samples (the leading dimension of every activation input
scaled up, parameters and buffers as they are) and stored per sample, which is how the cost model
scales it. In training an op runs at the micro-batch's size: at the captured batch of one its
tensors stay in the core's cache and a small product runs below the rate it reaches at the real
size, so batch-one times scaled up were 10-40% short for the memory-bound ops of the CPU benchmark
(``benchmarks/cost_model_accuracy.md``). An op without activation inputs (a factory) or whose output
comes out in another shape (sizes fixed in its arguments) is timed at its captured shapes.
"""

from __future__ import annotations

import ast
import dataclasses
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


CALIBRATION_SAMPLES = 8       # samples an op is timed at; its time is stored per sample


def _is_activation(ref) -> bool:
    """An input that grows with the samples: anything but a parameter or buffer."""
    return ref.kind not in ("param", "buffer")


def batched(op: Op, samples: int) -> Op:
    """``op`` with the leading dimension of every activation input and output times ``samples``."""
    def scale(meta):
        return dataclasses.replace(meta, shape=(meta.shape[0] * samples, *meta.shape[1:])) if meta.shape else meta
    inputs = tuple(scale(m) if _is_activation(r) else m for m, r in zip(op.inputs, op.sources))
    outputs = tuple(scale(m) for m in op.outputs)
    return dataclasses.replace(op, inputs=inputs, outputs=outputs, bytes_read=sum(m.nbytes for m in inputs),
                               bytes_written=sum(m.nbytes for m in outputs))


def time_op(op: Op, device: str, repeats: int, max_bytes: int,
            samples: int = CALIBRATION_SAMPLES) -> tuple[float, float] | None:
    """(forward_s, backward_s) per sample of one op (see the module docstring), or None if it cannot
    be replayed."""
    grows = any(m.shape and _is_activation(r) for m, r in zip(op.inputs, op.sources))
    if samples > 1 and grows:
        timing = _time_at(batched(op, samples), device, repeats, max_bytes)
        if timing is not None:
            return timing[0] / samples, timing[1] / samples
    return _time_at(op, device, repeats, max_bytes)


def _time_at(op: Op, device: str, repeats: int, max_bytes: int) -> tuple[float, float] | None:
    """(forward_s, backward_s) at the op's recorded shapes; None if it cannot be replayed there or its
    first output is not of the recorded shape."""
    if op.bytes_read + op.bytes_written > max_bytes:
        return None
    try:
        func, args, kwargs = replay_args(op, device)
        out = func(*args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if op.outputs and (not isinstance(first, torch.Tensor) or tuple(first.shape) != op.outputs[0].shape):
            return None
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
