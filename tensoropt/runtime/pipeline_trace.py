"""Tracing a model into pipeline stages, under the precision's autocast even when the model is on meta.

bf16-mixed stages are traced under ``torch.autocast`` so that their graphs cast as autocast does (a traced
``x.type_as(y)`` or ``dtype=x.dtype`` is fixed to the dtype the trace saw, and the stage-to-stage messages take
the traced dtypes). Autocast acts on no meta tensor (there is no meta autocast key), so a meta-built model is
traced on fake CPU tensors instead (``FakeTensorMode``: shapes, dtypes and a CPU device, no storage), under the
CPU's autocast, as the launcher's capture does; the stage modules then get meta tensors back in place of the
fake ones, so the engine materialises them as it does any stage cut on meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .precision import traced_autocast

CPU = torch.device("cpu")


def trace_pipeline(model: nn.Module, args: tuple, kwargs: dict, split_spec: dict, precision: str | None):
    """``torch.distributed.pipelining.pipeline`` of ``model`` on one micro-batch (``args``, ``kwargs``, on the
    model's device), under ``precision``'s autocast. A model on meta under bf16-mixed is traced on fake CPU
    tensors (module doc); its stage modules hold meta tensors again on return."""
    from torch.distributed.pipelining import pipeline
    device = next(iter(model.parameters())).device
    if device.type != "meta" or precision != "bf16-mixed":
        with traced_autocast(precision, device):
            return pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=split_spec)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in fakes:              # a tied parameter gets one fake, as it is one tensor
            fakes[id(t)] = FakeTensor(fake_mode, t.detach().to("meta"), CPU)
        return fakes[id(t)]
    with _swapped_states(model, fake), traced_autocast(precision, CPU):
        pipe = pipeline(model, mb_args=tuple(fake(a) for a in args), mb_kwargs={k: fake(v) for k, v in kwargs.items()},
                        split_spec=split_spec)
    _fakes_to_meta(pipe.split_gm)
    return pipe


@contextlib.contextmanager
def _swapped_states(model: nn.Module, replace) -> Iterator[None]:
    """Within: every parameter and buffer of ``model`` is ``replace(tensor)`` (a parameter stays a parameter);
    restored on leaving."""
    saved = []
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(module, kind)
            for name, tensor in list(slots.items()):
                if tensor is None:
                    continue
                saved.append((slots, name, tensor))
                new = replace(tensor)
                slots[name] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
    try:
        yield
    finally:
        for slots, name, tensor in saved:
            slots[name] = tensor


def _fakes_to_meta(root: nn.Module) -> None:
    """Every fake tensor ``root``'s modules hold (parameters, buffers, traced constants) replaced by a meta
    tensor of its shape and dtype; one fake held in several places gets one meta tensor."""
    metas: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in metas:
            empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            metas[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return metas[id(t)]
    for module in root.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(module, kind)
            for name, tensor in list(slots.items()):
                if isinstance(tensor, FakeTensor):
                    slots[name] = meta(tensor)
        for name, value in list(vars(module).items()):
            if isinstance(value, FakeTensor):
                setattr(module, name, meta(value))


__all__ = ["trace_pipeline"]
