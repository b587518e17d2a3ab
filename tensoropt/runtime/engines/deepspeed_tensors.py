"""The tensors a DeepSpeed optimizer holds outside the model, by the role the memory tracker names them with.

DeepSpeed keeps most of a rank's memory in its own objects, not in the module's parameters: the flat 16-bit
buffers the parameters are views of (``bit16_groups_flat``, ``bf16_groups_flat``), the float32 master
partitions the optimizer updates (``single_partition_of_fp32_groups`` in ZeRO 1-2,
``fp32_partitioned_groups_flat`` in ZeRO 3, ``fp32_groups_flat_partition`` in ``BF16_Optimizer``), the reduced
gradient partitions (``averaged_gradients``, ``grads_in_partition``, ``fp32_groups_gradients_flat``, ZeRO 3's
``__param_and_grad_partition``-style flats), the reduce buckets (``ipg_buckets``) and ZeRO 3's partitions of each
parameter (``param.ds_tensor``). Most are made in ``deepspeed.initialize``, before the tracker starts, so the
tracker (``memory.tracker.StepMemory``) sees them only once they are registered; this module finds them by
walking the optimizer's attributes (DeepSpeed 0.19: ``runtime/zero/stage_1_and_2.py``, ``stage3.py``,
``runtime/bf16_optimizer.py``) and names each by its attribute: a name with ``grad`` in it holds gradients,
one with ``fp32`` / ``master`` / ``single_partition`` the float32 master weights (optimizer states, as
``cost.model`` prices them: K = 12 counts the master copy), one with ``bit16`` / ``fp16`` / ``bf16`` /
``param`` the weights; anything else the optimizer holds (buckets, staging buffers) is a temporary.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

_HOST_WORDS = ("fp32", "cpu", "offload_gradient", "grad_partition")
_MAX_DEPTH = 3            # lists of lists of tensors (groups of partitions), dicts of bucket objects
_ROLES = (("gradients", ("grad",)), ("optimizer", ("fp32", "master", "single_partition")),
          ("parameters", ("bit16", "fp16", "bf16", "param")))


def role_of(attribute: str, offloading: bool = False) -> str:
    """The tracker category of what a DeepSpeed optimizer attribute holds (module doc); ``offloaded`` for what an
    offloading optimizer keeps in host memory (``offload_optimizer``: its float32 partitions and their gradients,
    the host staging buffers; ZeRO 3's gradient partitions, ``stage3.py`` allocating them on the offload device)."""
    name = attribute.lower()
    if offloading and any(w in name for w in _HOST_WORDS):
        return "offloaded"
    for role, words in _ROLES:
        if any(w in name for w in words):
            return role
    return "temporaries"


def _tensors(value: object, depth: int) -> Iterator[torch.Tensor]:
    """The tensors in an attribute's value; meta tensors (DeepSpeed keeps meta copies of the parameters' shapes,
    ``round_robin_bit16_meta``) hold no memory and are left out."""
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            yield value
    elif depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
    elif depth < _MAX_DEPTH and hasattr(value, "__dict__") and type(value).__module__.startswith("deepspeed") \
            and not isinstance(value, (nn.Module, torch.optim.Optimizer)):
        for v in vars(value).values():          # a bucket object (``ipg_buckets``' values)
            yield from _tensors(v, depth + 1)


def host_gradients(partitions: list[torch.Tensor]) -> list[torch.Tensor]:
    """The ``.grad`` of an offloading optimizer's host partitions: ZeRO 3 gives each float32 partition a host
    gradient buffer at initialisation and keeps it (``stage3.py`` ``initialize_optimizer_states``:
    ``fp32_partitioned_groups_flat[i].grad``, allocated on the offload device and never set to None under
    offload). It is held by no attribute of its own, so it would otherwise be counted as device memory."""
    return [p.grad for p in partitions if isinstance(p.grad, torch.Tensor) and not p.grad.is_meta]


def deepspeed_tensors(model: nn.Module, optimizer: object) -> dict[str, list[torch.Tensor]]:
    """{role: tensors} held by a DeepSpeed ``optimizer`` (not the torch optimizer it wraps, whose states
    ``memory_check.register_model`` names, unless it steps on the host: ``offloaded``) and ZeRO 3's parameter
    partitions of ``model``; empty for anything that is not DeepSpeed's."""
    found: dict[str, list[torch.Tensor]] = {}
    if not type(optimizer).__module__.startswith("deepspeed"):
        return found
    offloading = bool(getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False))
    for attribute, value in vars(optimizer).items():
        found.setdefault(role_of(attribute, offloading), []).extend(_tensors(value, 0))
    inner = getattr(optimizer, "optimizer", None)
    if offloading and isinstance(getattr(inner, "state", None), dict):     # the torch optimizer steps on the host
        found.setdefault("offloaded", []).extend(t for s in inner.state.values() for t in _tensors(s, 1))
    if offloading:      # the host partitions' float32 gradients, which the host's step reads (``host_gradients``)
        found.setdefault("offloaded", []).extend(host_gradients(found.get("offloaded", [])))
    partitions = [p.ds_tensor for p in model.parameters() if isinstance(getattr(p, "ds_tensor", None), torch.Tensor)]
    found.setdefault("parameters", []).extend(partitions)
    return found


__all__ = ["deepspeed_tensors", "host_gradients", "role_of"]
