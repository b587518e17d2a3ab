"""This machine's device name and memory, read without importing torch for a CPU (the launcher plans CPU workers
without it); a GPU's through ``torch.cuda``, in the profiler's process."""

from __future__ import annotations

import platform
from pathlib import Path


def device_name(device: str) -> str:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def memory_bytes(device: str) -> int:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the host's memory size")


__all__ = ["device_name", "memory_bytes"]
