"""Where this machine's measured profiles live, so that a launch finds them without being told.

``tensoropt profile`` without ``--out`` writes ``$TENSOROPT_PROFILE_DIR/<device>.json`` (default
``~/.cache/tensoropt/profiles``), named after the device it measured (``nvidia-h100-80gb-hbm3.json``).
``tensoropt launch`` plans with the profile of the device it finds there, else with the device's
datasheet profile (``profiles/``); ``--profile`` overrides both. The launch prints which it used.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PROFILE_DIR_ENV = "TENSOROPT_PROFILE_DIR"


def measured_dir() -> Path:
    return Path(os.environ.get(PROFILE_DIR_ENV) or Path.home() / ".cache" / "tensoropt" / "profiles")


def device_slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "device"


def measured_path(device_name: str) -> Path:
    """Where this machine keeps the measured profile of ``device_name``."""
    return measured_dir() / f"{device_slug(device_name)}.json"


def find_measured(device_name: str) -> Path | None:
    path = measured_path(device_name)
    return path if path.is_file() else None


DATASHEETS = (("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-80gb"))


def datasheet_profile(device_name: str) -> str:
    """The datasheet profile in ``profiles/`` of a GPU by its name; a one-line error for an unknown GPU."""
    from ..errors import TensorOptError
    name = device_name.lower()
    for key, profile in DATASHEETS:
        if key in name:
            return profile
    raise TensorOptError(f"no device profile for {device_name!r}: run `tensoropt profile --device cuda` (or with "
                         "--out profiles/NAME.json and pass --profile profiles/NAME.json)")


def threads_per_worker(nproc: int) -> int:
    """Host threads one of ``nproc`` workers on this machine gets: the cores this process may run on,
    shared evenly. The profile measures the host optimizer with as many, and the launcher gives GPU
    workers as many (``OMP_NUM_THREADS``), so that offload runs at the rate it was priced at."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, nproc))


__all__ = ["DATASHEETS", "PROFILE_DIR_ENV", "datasheet_profile", "device_slug", "find_measured", "measured_dir",
           "measured_path", "threads_per_worker"]
