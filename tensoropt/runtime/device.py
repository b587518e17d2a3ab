"""Where a worker trains: its device, its process group, and the check that everything is there.

One code path for GPUs and CPUs. The plan says which kind of device it was made for (``RunPlan.device``,
written by the launcher); a worker binds itself to ``cuda:LOCAL_RANK`` for a GPU plan (NCCL for GPU
tensors, gloo beside it for CPU ones) or to the CPU (gloo). Nothing else in the runtime asks which kind
it runs on: modules and batches go to ``worker_device(...)``, whatever it is.

A plan made for GPUs must never train anywhere else: a model left on the host trains, slowly and
silently, and its measurements mean nothing. ``misplaced`` names what is not on the device, and the
runtime stops with one line when anything is.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..errors import TensorOptError
from ..space.run_plan import DEVICE_KINDS, RunPlan


def default_kind() -> str:
    """The kind of device this process would train on by itself: a GPU where one is visible."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def worker_device(plan: RunPlan | None) -> torch.device:
    """This worker's device for ``plan``: ``cuda:LOCAL_RANK`` (made current) or the CPU. A GPU plan on a
    worker that sees no GPU, or fewer GPUs than its local rank, is a one-line error."""
    kind = (plan.device if plan is not None else "") or default_kind()
    if kind not in DEVICE_KINDS:
        raise TensorOptError(f"plan device {kind!r} is unknown: use one of {', '.join(DEVICE_KINDS)}")
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local >= visible:
        raise TensorOptError(f"the plan trains on GPUs, but worker {local} sees {visible} GPU(s) "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch "
                             "with --gpus at most the GPUs visible, or plan for --device cpu")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_process_group(device: torch.device) -> None:
    """Join the job's process group for ``device``: NCCL for GPU tensors with gloo beside it (losses and
    checkpoint metadata may sit on the host), gloo alone on CPUs."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    local = local_tensor(t).device
    return local.type == device.type and (device.index is None or local.index == device.index)


def misplaced(named: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> list[str]:
    """'name (device)' of every tensor not on ``device``."""
    return [f"{name} ({local_tensor(t).device})" for name, t in named if not on_device(t, device)]


def check_placement(module: nn.Module, device: torch.device, where: str) -> None:
    """Stop with one line if a parameter or buffer of ``module`` is not on ``device``."""
    wrong = misplaced(list(module.named_parameters()) + list(module.named_buffers()), device)
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise TensorOptError(f"{where}: {', '.join(wrong[:3])}{more} not on {device}, where the plan trains: keep "
                             "the model where tensoropt.parallelize put it (do not move it after the call)")


def free_memory_bytes(device: torch.device) -> int:
    """Memory a new tensor on ``device`` can still take: the GPU's free memory, or the host's available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil
    return psutil.virtual_memory().available


def to_device(batch, device: torch.device):
    """Every tensor of a batch (a tensor, tuple, list or mapping of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(to_device(v, device) for v in batch)
    if isinstance(batch, list):
        return [to_device(v, device) for v in batch]
    return batch


__all__ = ["DEVICE_KINDS", "check_placement", "default_kind", "free_memory_bytes", "init_process_group",
           "local_tensor", "misplaced", "on_device", "to_device", "worker_device"]
