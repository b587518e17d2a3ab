"""The GPUs a launch may use, found without a CUDA context in the launcher process.

Why not ``torch.cuda``: ``torch.cuda.mem_get_info(i)`` creates a context on GPU i (~0.5 GiB) that lives as
long as the process, and the launcher lives as long as the job, so every worker would lose that memory.
Why not ``nvidia-smi -L`` alone: it lists every GPU of the machine whatever ``CUDA_VISIBLE_DEVICES`` says,
and lists MIG instances as separate lines.

So the devices are the listing filtered the way CUDA filters it (``cuda_visible``), then what one worker
process can address (``usable``), then capped by ``--gpus``; free memory comes from
``nvidia-smi --query-gpu`` (by UUID), or for a MIG instance from ``python -m launcher.gpus memory N``, a
short-lived process whose context ends with it. Elastic runs and plain launches both count with
``gpu_count``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from tensoropt.errors import TensorOptError

NVIDIA_SMI = "nvidia-smi"
QUERY_TIMEOUT_S = 60
MIB = 2**20
_GPU_LINE = re.compile(r"^GPU (\d+): (.*?) \(UUID: (GPU-[^)\s]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)\s]+)\)")


@dataclass(frozen=True)
class Gpu:
    """One device CUDA can enumerate: a whole GPU, or one MIG instance of a GPU (``mig`` is its profile name,
    e.g. ``3g.40gb``; ``name`` is then the parent GPU's)."""
    index: int                   # nvidia-smi's index of the physical GPU
    name: str
    uuid: str                    # GPU-... or MIG-...
    mig: str = ""


@dataclass(frozen=True)
class Listed:
    """One physical GPU of ``nvidia-smi -L`` with the MIG instances listed under it (none: MIG is off)."""
    gpu: Gpu
    instances: tuple[Gpu, ...] = ()

    def devices(self) -> list[Gpu]:
        """What CUDA enumerates for it: the GPU, or on a MIG-enabled GPU its instances (never the GPU itself)."""
        return list(self.instances) or [self.gpu]


def parse_listing(text: str) -> list[Listed]:
    """The GPUs of an ``nvidia-smi -L`` listing, each with the MIG instances indented under it."""
    listed: list[Listed] = []
    for line in text.splitlines():
        if match := _GPU_LINE.match(line):
            listed.append(Listed(Gpu(int(match[1]), match[2].strip(), match[3])))
        elif (match := _MIG_LINE.match(line)) and listed:
            parent = listed[-1]
            listed[-1] = Listed(parent.gpu, (*parent.instances, Gpu(parent.gpu.index, parent.gpu.name, match[3],
                                                                       match[1])))
    return listed


def _entry(entry: str, listed: list[Listed]) -> list[Gpu] | None:
    """The devices one CUDA_VISIBLE_DEVICES entry names, or None where CUDA stops reading: an index (read as
    C's strtoul reads it: "1gpu" is 1), a unique GPU- or MIG- UUID prefix, or the old MIG-GPU-uuid/gi/ci form."""
    if match := re.match(r"^\+?(\d+)", entry):
        found = [item for item in listed if item.gpu.index == int(match[1])]
        return found[0].devices() if found else None
    if entry.startswith("MIG-GPU-"):
        parent = [item for item in listed if item.gpu.uuid.startswith(entry[4:].split("/")[0])]
        if len(parent) != 1 or not parent[0].instances:
            return None
        return list(parent[0].instances[:1])
    if entry.startswith("MIG-"):
        found = [mig for item in listed for mig in item.instances if mig.uuid.startswith(entry)]
        return found if len(found) == 1 else None
    if entry.startswith("GPU-"):
        found = [item for item in listed if item.gpu.uuid.startswith(entry)]
        return found[0].devices() if len(found) == 1 else None
    return None


def cuda_visible(listed: list[Listed], cuda_visible_devices: str | None) -> list[Gpu]:
    """The devices CUDA enumerates, in its order, as the CUDA environment-variable reference describes
    ``CUDA_VISIBLE_DEVICES``: unset, all of them; else the entries in the given order, stopping at the
    first that names no device (a negative index, an unknown or ambiguous UUID); a device named twice
    makes the set empty (as ``torch.cuda``'s own parser of the variable has it). Indices are read as
    nvidia-smi's, which is CUDA's order on a node of identical GPUs (CUDA orders the fastest first, ties
    by PCI bus, as nvidia-smi does)."""
    if cuda_visible_devices is None:
        return [device for item in listed for device in item.devices()]
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        devices = _entry(entry, listed) if entry else None
        if devices is None:
            break
        if any(device in chosen for device in devices):
            return []
        chosen += devices
    return chosen


def usable(visible: list[Gpu]) -> list[Gpu]:
    """The devices one worker process can address as ``cuda:LOCAL_RANK``: every whole GPU and at most one
    MIG instance, since a CUDA process enumerates a single MIG device however many are visible (NVIDIA MIG
    user guide, "CUDA Device Enumeration"); the workers of a launch share one CUDA_VISIBLE_DEVICES."""
    whole = [device for device in visible if not device.mig]
    return whole + [device for device in visible if device.mig][:1]


def listing() -> list[Listed] | None:
    """``nvidia-smi -L`` parsed; None where nvidia-smi is missing or fails (no NVIDIA driver here)."""
    try:
        result = subprocess.run([NVIDIA_SMI, "-L"], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_listing(result.stdout) if result.returncode == 0 else None


def visible_gpus() -> tuple[list[Gpu], list[Gpu]] | None:
    """(the devices CUDA would enumerate here, the ones a launch's workers can use); None without nvidia-smi."""
    listed = listing()
    if listed is None:
        return None
    visible = cuda_visible(listed, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return visible, usable(visible)


def gpu_count(requested: int | None = None) -> int | None:
    """How many GPUs a launch can use now: those CUDA_VISIBLE_DEVICES leaves visible, at most one MIG
    instance, capped by ``requested`` (``--gpus``); None where nvidia-smi cannot say."""
    found = visible_gpus()
    if found is None:
        return None
    count = len(found[1])
    return min(count, requested) if requested else count


def free_memory(devices: list[Gpu]) -> list[tuple[int, int]]:
    """(free, total) bytes of each device. Whole GPUs: ``nvidia-smi --query-gpu`` by UUID, no CUDA at all.
    MIG instances (nvidia-smi reports memory per physical GPU): a short-lived ``python -m launcher.gpus
    memory N`` process, so the context it creates ends with it."""
    if any(device.mig for device in devices):
        return _memory_in_subprocess(len(devices))
    try:
        result = subprocess.run([NVIDIA_SMI, "--query-gpu=uuid,memory.free,memory.total",
                                 "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise TensorOptError(f"cannot read the GPUs' free memory with nvidia-smi: {exc}") from exc
    memory = {}
    for line in result.stdout.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            memory[fields[0]] = (int(fields[1]) * MIB, int(fields[2]) * MIB)
    missing = [device.uuid for device in devices if device.uuid not in memory]
    if result.returncode != 0 or missing:
        raise TensorOptError(f"nvidia-smi --query-gpu reported no memory for {', '.join(missing) or 'any GPU'} "
                             f"(exit status {result.returncode}): check the driver, or pass --mem-per-gpu")
    return [memory[device.uuid] for device in devices]


def _memory_in_subprocess(count: int) -> list[tuple[int, int]]:
    result = subprocess.run([sys.executable, "-m", "launcher.gpus", "memory", str(count)], capture_output=True,
                            text=True, timeout=QUERY_TIMEOUT_S)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise TensorOptError(f"cannot read the GPUs' free memory: {last}")
    return [tuple(pair) for pair in json.loads(result.stdout)]


def main(argv: list[str]) -> int:
    """``python -m launcher.gpus memory N``: JSON [[free, total], ...] bytes of cuda:0..N-1 as this process
    sees them. Run it as a child process: the CUDA context it creates lives only as long as it does."""
    if len(argv) != 2 or argv[0] != "memory" or not argv[1].isdigit():
        print("usage: python -m launcher.gpus memory N", file=sys.stderr)
        return 2
    import torch
    count = int(argv[1])
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < count:
        print(f"error: this process sees {seen} GPU(s), {count} asked for", file=sys.stderr)
        return 1
    print(json.dumps([list(torch.cuda.mem_get_info(i)) for i in range(count)]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
