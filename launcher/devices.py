"""The devices a launch plans for: the GPUs found (and their free memory), CPU workers, or, for a dry
run on a machine without GPUs, GPUs described by a device profile.

The profile planned with is ``--profile`` if given, else this machine's measured profile of the device
(``tensoropt profile`` without ``--out`` writes it, see ``tensoropt.profiler.store``), else the device's
datasheet profile (``cpu-2core`` for CPU workers). The launch prints which.

Everything a launch cannot run on is said here, in one line, before any worker starts: more GPUs asked
for than are visible, a GPU another process already fills, no GPU at all.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from tensoropt.cost.profile import DeviceProfile, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.profiler.host import device_name, memory_bytes
from tensoropt.profiler.store import datasheet_profile, find_measured

from .gpus import Gpu, free_memory, visible_gpus
from .wiring import wiring

GIB = 2**30
DEFAULT_GPU_PROFILE = "h100-80gb"
# free memory below this share of a GPU's total is worth saying when no plan fits: someone else holds it
IN_USE_SHARE = 0.9


@dataclass(frozen=True)
class Devices:
    kind: str                       # cuda | cpu: what the workers train on (plan.json's "device")
    count: int
    memory_bytes: int
    profile: DeviceProfile
    profile_name: str = ""          # the profile planned with, as the user would name it
    note: str = ""                  # what the user should know when no plan fits (memory held by others)


def detect(device: str | None, gpus: int | None, mem_per_gpu: float | None, profile: str | None = None,
           dry_run: bool = False) -> Devices:
    """The devices this launch plans for (see module doc). GPUs are found with nvidia-smi, never with
    ``torch.cuda`` in this process (see ``launcher.gpus``)."""
    if device == "cpu":
        if not gpus:
            raise TensorOptError("--device cpu needs --gpus N: the number of CPU worker processes")
        name = profile or _measured(device_name("cpu")) or "cpu-2core"
        memory = int(mem_per_gpu or memory_bytes("cpu") // gpus)
        return Devices("cpu", gpus, memory, dataclasses.replace(load_profile(name), memory_bytes=memory),
                       _described(name, profile))
    found = visible_gpus()
    if found and found[1]:
        return _visible_gpus(found[1], gpus, mem_per_gpu, profile, mig_hidden=len(found[0]) - len(found[1]))
    if device == "cuda" and dry_run:
        if not gpus:
            raise TensorOptError("planning for GPUs this machine does not have needs --gpus N (per node)")
        name = profile or DEFAULT_GPU_PROFILE
        loaded = load_profile(name)
        if mem_per_gpu and mem_per_gpu > loaded.memory_bytes:
            raise TensorOptError(f"--mem-per-gpu {mem_per_gpu / GIB:.1f} GiB is more than the {name} profile's "
                                 f"{loaded.memory_bytes / GIB:.1f} GiB per device: ask for less, or plan with a larger "
                                 "--profile")
        memory = int(mem_per_gpu or loaded.memory_bytes)
        return Devices("cuda", gpus, memory, dataclasses.replace(loaded, memory_bytes=memory), name,
                       note=f"no GPU here: planned with the {name} profile")
    if found is not None:
        raise TensorOptError(f"nvidia-smi lists GPUs but CUDA_VISIBLE_DEVICES={_cvd()} leaves none visible: name "
                             "some in it, or pass --device cpu --gpus N")
    raise TensorOptError("no GPU found on this machine; pass --device cpu --gpus N to run CPU workers over gloo, or "
                         "--device cuda --gpus N --dry-run to plan for GPUs")


def _cvd() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "unset" if value is None else repr(value)


def _visible_gpus(usable: list[Gpu], gpus: int | None, mem_per_gpu: float | None, profile: str | None,
                  mig_hidden: int = 0) -> Devices:
    """The first ``gpus`` usable devices (all by default) and the least free memory among them."""
    visible = len(usable)
    count = gpus or visible
    if count > visible:
        mig = f"; {mig_hidden + 1} MIG instances are visible, but a CUDA process sees only one" if mig_hidden else ""
        raise TensorOptError(f"--gpus {count} asks for more GPUs than the {visible} visible here "
                             f"(CUDA_VISIBLE_DEVICES={_cvd()}{mig}): use --gpus {visible} or fewer, or --nnodes to "
                             "span machines")
    free_total = free_memory(usable[:count])
    index, (free, total) = min(enumerate(free_total), key=lambda item: item[1][0])
    gpu_name = usable[0].name
    name = profile or _measured(gpu_name) or datasheet_profile(gpu_name)
    if mem_per_gpu and mem_per_gpu > free:
        raise TensorOptError(f"--mem-per-gpu {mem_per_gpu / GIB:.1f} GiB is more than the {free / GIB:.1f} GiB free on "
                             f"GPU {index}: ask for less, or free the GPU")
    memory = int(mem_per_gpu or free)
    note = f"GPU {index} has {free / GIB:.1f} of {total / GIB:.1f} GiB free (another process holds the rest)" \
        if free < IN_USE_SHARE * total else ""
    loaded, described = dataclasses.replace(load_profile(name), memory_bytes=memory), _described(name, profile)
    peers = 0 if loaded.intra_node.direct_peers else wiring(usable[:count])
    if peers:
        # a board without an NVSwitch: each GPU's links are split over its peers (``launcher.wiring``)
        loaded = dataclasses.replace(loaded, intra_node=dataclasses.replace(loaded.intra_node, direct_peers=peers))
        described += f", its NVLinks wired directly to {peers} peers (nvidia-smi topo)"
    return Devices("cuda", count, memory, loaded, described, note)


def _measured(name: str) -> str | None:
    path = find_measured(name)
    return str(path) if path else None


def _described(name: str, given: str | None) -> str:
    """The profile as the launch reports it: a measured one found on this machine says so."""
    return name if given or not name.endswith(".json") else f"{name} (measured on this machine)"


__all__ = ["Devices", "detect"]
