"""Autocast at capture: each captured op carries the dtype it really computes in.

A script that trains under ``torch.autocast(device_type="cuda", dtype=torch.bfloat16)`` (nanoGPT,
torchtitan) keeps float32 parameters but runs its matrix products, and saves most activations, in bf16.
The capture runs on fake tensors, and autocast only acts on tensors of its device (meta tensors have
none), so a forward under autocast is traced on fake *CPU* tensors (still nothing allocated) under a CPU
autocast of the same dtype: the ops record the dtypes autocast gives them, and the cost model prices
compute, activations and the bf16 weight copies by them. A CUDA autocast is mapped to a CPU one of the
same dtype (``cuda_autocast_on_cpu``): the capture never runs on a GPU, and on a machine without one
torch would otherwise switch a CUDA autocast off. The two devices' autocast lists agree on what matters for
cost (matrix products, convolutions and attention in the lower precision, reductions such as softmax and
losses in float32); they differ on a few rarer ops.

In bf16-mixed the engines differ in what the autocast computes with. DDP and one process keep float32 weights:
autocast casts each weight per op, and the embedding's output and the residual stream between ops stay float32.
FSDP2 (``param_dtype=bf16``) and DeepSpeed's bf16 mode compute with bf16 weights: the stream is bf16 and no
per-op weight copy is made. The launcher captures both (``with_bf16_weights``), and each plan is priced with the
one its engine runs (``search.engines.priced_graph``). ``engines_autocast`` and ``weights_in_bf16`` are the two
conditions of those captures, shared by the launcher's (``runtime._write_capture``) and ``tensoropt.capture(...,
precision=...)``, so a ``--model`` planned by ``tensoropt frontier`` is priced as the launcher prices its script.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.amp.autocast_mode import autocast

AUTOCAST_DEVICES = ("cpu", "cuda")


def active_autocast() -> torch.dtype | None:
    """The dtype of the autocast region the caller runs in (CPU or CUDA), None outside any."""
    for device in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


@contextlib.contextmanager
def cuda_autocast_on_cpu() -> Iterator[None]:
    """Within: ``torch.autocast("cuda", dtype)`` (and ``torch.cuda.amp.autocast``) is a CPU autocast of the
    same dtype (float16 when none is given, CUDA's default), so a capture sees the script's CUDA autocast on
    any machine. Only for capture: nothing computes on a GPU there."""
    original = autocast.__init__
    if getattr(original, "_tensoropt_on_cpu", False):          # nested: already mapped
        yield
        return

    def on_cpu(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
               cache_enabled: bool | None = None) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.get_autocast_dtype("cuda")
        original(self, device_type, dtype, enabled, cache_enabled)
    on_cpu._tensoropt_on_cpu = True
    autocast.__init__ = on_cpu
    try:
        yield
    finally:
        autocast.__init__ = original


@contextlib.contextmanager
def cuda_attention_policy() -> Iterator[None]:
    """Within: under an autocast, ``scaled_dot_product_attention`` computes in the autocast's dtype, as CUDA's
    autocast runs it (its lower-precision list); the CPU's leaves it to its inputs' dtype, so float32 queries
    (after a float32 rotary embedding, say) would be captured, and priced, as float32 attention that a GPU worker
    never runs. For captures in bf16-mixed only: nothing computes there."""
    original = torch.nn.functional.scaled_dot_product_attention

    def lower(query, key, value, *args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        if dtype is not None:
            query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
        return original(query, key, value, *args, **kwargs)
    torch.nn.functional.scaled_dot_product_attention = lower
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def engines_autocast(precision: str | None) -> Iterator[None]:
    """Within: what the engines compute under in ``precision``, for a capture: bf16-mixed's bf16 autocast (on GPUs,
    CUDA's: ``cuda_attention_policy``; a CPU one here, see the module doc); nothing for the other precisions."""
    with contextlib.ExitStack() as scope:
        if precision == "bf16-mixed":
            scope.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            scope.enter_context(cuda_attention_policy())
        yield


@contextlib.contextmanager
def weights_in_bf16(model: nn.Module) -> Iterator[None]:
    """Within: the model's floating-point parameters in bf16, as FSDP2's ``param_dtype`` gathers them (buffers
    stay: FSDP2 casts parameters only); after, the very tensors they were, so nothing is rounded."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    kept = [p.data for p in params]
    for param in params:
        param.data = param.data.to(torch.bfloat16)
    try:
        yield
    finally:
        for param, data in zip(params, kept):
            param.data = data
