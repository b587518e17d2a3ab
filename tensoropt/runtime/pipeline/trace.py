"""Tracing a model into pipeline stages, under the precision's autocast even when the model is on meta.

bf16-mixed stages are traced under ``torch.autocast`` so that their graphs cast as autocast does (a traced
``x.type_as(y)`` or ``dtype=x.dtype`` is fixed to the dtype the trace saw, and the stage-to-stage messages take
the traced dtypes). Autocast acts on no meta tensor (there is no meta autocast key), so a meta-built model is
traced on fake CPU tensors instead (``FakeTensorMode``: shapes, dtypes and a CPU device, no storage), under the
CPU's autocast, as the launcher's capture does; the stage modules then get meta tensors back in place of the
fake ones, so the engine materialises them as it does any stage cut on meta.

Where FSDP2 will run the stages with bf16 weights (bf16-mixed under ZeRO 1-3: ``MixedPrecisionPolicy(param_dtype=
bf16)``, ``search.engines.computes_with_bf16_weights``) they are traced with bf16 weights too, as fakes whatever
the model's device: the graphs then compute as FSDP2 runs them, with a bf16 residual stream and bf16 messages
between stages (traced with the float32 master weights under autocast, the stream stayed float32, twice the
bytes Megatron-LM keeps, and the messages too). The stage modules get the model's own parameters and buffers back
(float32: the master copy FSDP2 shards), found by name.

The model is traced returning its loss alone (``_loss_only``): a Hugging Face causal LM returns an output with
``.loss`` and ``.logits`` (``torch.export`` flattens it to a tuple), and the last stage must hand the schedule the
loss, the value ``run.train_step`` averages, as the model computes it (its label shifting included: it is inside the
forward). The logits still feed the loss inside the last stage but are not returned (the script reads the loss from
``train_step``, never the model's output, under every plan).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ...graph.loss import loss_tensor
from ..engines.precision import traced_autocast

CPU = torch.device("cpu")


def trace_pipeline(model: nn.Module, args: tuple, kwargs: dict, split_spec: dict, precision: str | None,
                   bf16_weights: bool = False):
    """``torch.distributed.pipelining.pipeline`` of ``model`` on one micro-batch (``args``, ``kwargs``, on the
    model's device), under ``precision``'s autocast. A model on meta under bf16-mixed is traced on fake CPU
    tensors (module doc); its stage modules hold meta tensors again on return. ``bf16_weights``: traced with its
    floating-point parameters in bf16, as FSDP2 gathers them (module doc); the stage modules hold the model's own
    parameters and buffers on return."""
    from torch.distributed.pipelining import pipeline
    device = next(iter(model.parameters())).device
    if not bf16_weights and (device.type != "meta" or precision != "bf16-mixed"):
        with traced_autocast(precision, device), _loss_only(model):
            return pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=split_spec)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    parameters = {id(p) for p in model.parameters()}
    originals = _named_states(model)

    def fake(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in fakes:              # a tied parameter gets one fake, as it is one tensor
            meta = t.detach().to("meta")
            if bf16_weights and id(t) in parameters and meta.is_floating_point():
                meta = meta.to(torch.bfloat16)
            fakes[id(t)] = FakeTensor(fake_mode, meta, CPU)
        return fakes[id(t)]
    with _swapped_states(model, fake), traced_autocast(precision, CPU), _loss_only(model):
        pipe = pipeline(model, mb_args=tuple(fake(a) for a in args), mb_kwargs={k: fake(v) for k, v in kwargs.items()},
                        split_spec=split_spec)
    if bf16_weights:
        _restore_states(pipe, originals)
    _fakes_to_meta(pipe.split_gm)
    return pipe


@contextlib.contextmanager
def _loss_only(model: nn.Module) -> Iterator[None]:
    """Within: ``model``'s forward returns the loss its output carries (``output.loss``, ``output["loss"]``) in
    place of the output, so the last stage computes the loss and nothing after it (module doc); a tensor, or an
    output without a loss, is returned as it is (the cut then says what the last stage must return). The same
    forward under the same signature (``functools.wraps``: ``torch.export`` binds the example's keyword arguments to
    it), set on the instance and taken off on leaving."""
    own = vars(model).get("forward")
    forward = model.forward

    @functools.wraps(forward)
    def loss_forward(*args, **kwargs):
        output = forward(*args, **kwargs)
        loss = None if isinstance(output, torch.Tensor) else loss_tensor(output)
        return output if loss is None else loss
    model.forward = loss_forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _named_states(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under each of its names (a tied one under all of them)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    out[f"{prefix}.{name}" if prefix else name] = tensor
    return out


def _restore_states(pipe, originals: dict[str, torch.Tensor]) -> None:
    """Give each stage module the model's own tensors back in place of the fakes it was traced with, by name (the
    stage modules keep the model's names): a parameter as the very parameter (tied ones stay one object)."""
    for index in range(pipe.num_stages):
        stage = pipe.get_stage_module(index)
        for prefix, module in stage.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                slots = getattr(module, kind)
                for name, tensor in list(slots.items()):
                    full = f"{prefix}.{name}" if prefix else name
                    if isinstance(tensor, FakeTensor) and full in originals:
                        slots[name] = originals[full]


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
