"""The training precision a plan names (``--precision``, PyTorch Lightning's names), applied by the engines.

- ``32-true``: float32 weights, gradients, AdamW states and compute. A model built in bf16 is cast to float32.
- ``bf16-true``: the model cast to bf16: weights, gradients and AdamW states in bf16, no float32 copy.
- ``bf16-mixed``: float32 weights (the master copy) and AdamW states, bf16 compute. The model is cast to
  float32; under FSDP2 (ZeRO 1-3) every unit gathers its weights in bf16 and reduces its gradients in float32
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``, as torchtitan trains), or in bf16 for a plan
  with bf16 gradients (``Plan.grad_dtype``, ``reduce_dtype=bf16``: the leaner state layout); everywhere (DDP,
  tensor parallel, one process, pipeline stages, and over FSDP2 and DeepSpeed too) the forward, which returns
  the loss, runs under ``torch.autocast(bf16)``. Over FSDP2's bf16 weights autocast casts nothing more, but
  keeps the ops autocast runs in float32 (softmax, norms, losses) in float32 exactly as the script run alone
  in bf16-mixed does, so the two differ only by the order of reductions. DeepSpeed's own ``bf16`` section
  holds bf16 weights and the float32 master copy (``deepspeed_engine.precision_config``).

The cast comes first, before sharding and materialisation: on a meta-built model it costs nothing, and the
model run alone in the same precision (``PRECISION_ENV``) is cast at the same point, so a meta-built model is
initialised in the same dtype in both.

A script that trains under its own bf16 autocast keeps it: ``bf16-mixed`` then adds nothing it would notice
(an autocast inside one of the same dtype is the same region; FSDP2's bf16 weights are the copies its autocast
would make), and the launcher refuses the other precisions for it, which its autocast would contradict.

Run by hand (no plan), the script is unchanged unless ``TENSOROPT_PRECISION`` names a precision: then it runs
in it, the reference a launched run in that precision is compared with.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ...errors import TensorOptError


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype the model's weights are kept in (the master copy in bf16-mixed)."""
    return torch.bfloat16 if precision == "bf16-true" else torch.float32


def cast_model(model: nn.Module, precision: str | None) -> None:
    """Cast the model's floating-point parameters and buffers to ``precision``'s weight dtype (in place: the
    parameter objects stay, so a materialiser or the script's references still find them; on meta nothing is
    allocated). Tied parameters stay tied: under the memory simulation's ``FakeTensorMode`` a meta parameter cast
    to another dtype comes back as a fake tensor, which ``Module._apply`` cannot set as the old one's data, so each
    name got a parameter of its own (a bf16-built GPT's head then no longer read its embedding's weight)."""
    if precision is not None:
        from ..memory.materialize import tie, tied_parameters
        tied = tied_parameters(model)
        model.to(parameter_dtype(precision))
        for names in tied:
            tie(model, names)


def fsdp_kwargs(precision: str | None, grad_dtype: str = "") -> dict:
    """``fully_shard`` arguments for ``precision``: bf16-mixed gathers bf16 and reduces float32 gradients, or with
    ``grad_dtype`` "bfloat16" (the plan's bf16 gradients) reduces them in bf16: FSDP2 then keeps the gradients
    autograd makes on the bf16 weights as they are (a ``reduce_dtype`` equal to ``param_dtype`` is no cast,
    ``FSDPParam.init_dtype_attrs``), accumulating them in bf16 while gradient sync is off (ZeRO 1), and casts each
    reduced shard to the float32 parameters' dtype (``cost.states`` says what is held)."""
    if precision != "bf16-mixed":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy  # here: the launcher imports this module too
    reduce_dtype = torch.bfloat16 if grad_dtype == "bfloat16" else torch.float32
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)}


def _under_autocast(forward, device_type: str, *args, **kwargs):
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        return forward(*args, **kwargs)


def autocast_forward(module: nn.Module, precision: str | None, device: torch.device) -> None:
    """bf16-mixed: ``module``'s forward (and so the loss it returns) runs under a bf16 autocast of ``device``'s
    type. The forward is replaced on the instance, so parameter names and wrapping modules (DDP, FSDP2's hooks)
    are as they were."""
    if precision == "bf16-mixed":
        module.forward = functools.partial(_under_autocast, module.forward, device.type)


def traced_autocast(precision: str | None, device: torch.device):
    """bf16-mixed where the model is traced into a graph (pipeline stages, ``torch.export``): the trace runs under
    the autocast, so the graph itself casts as autocast does (and its message dtypes say so)."""
    if precision != "bf16-mixed":
        return contextlib.nullcontext()
    # autocast acts on no meta tensor: the graph would not say what runs (runtime.pipeline.trace traces a meta-built
    # model's stages on fake CPU tensors instead, so this guards other callers)
    if device.type == "meta":
        raise TensorOptError("bf16-mixed pipeline stages are traced under autocast, which does not act on a model "
                             "built on the meta device: build it for real, or launch with --precision bf16-true or "
                             "32-true")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


__all__ = ["autocast_forward", "cast_model", "fsdp_kwargs", "parameter_dtype", "traced_autocast"]
