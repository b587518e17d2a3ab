"""Everything ``tensoropt launch`` is given, checked before any work: before the script is captured, a plan
is searched, a file is written or a worker starts. Each problem is one line naming the flag and what to
change (``TensorOptError``); the checks that need the model (a ``--plan``'s blocks against the script's)
come after the capture, in ``launcher.cli``."""

from __future__ import annotations

import json
from pathlib import Path

from tensoropt.errors import TensorOptError, first_line
from tensoropt.options import MAX_DEVICES
from tensoropt.paths import check_output_dir
from tensoropt.profiler.host import memory_bytes
from tensoropt.space.plan import plan_problems
from tensoropt.units import parse_bytes

from .elastic import read_resources

# CPU workers share the host: more than this many is a typo, not a test (each is a Python with torch, ~0.3 GB)
MAX_CPU_WORKERS = 256
MAX_PORT = 65535


def read_plan(path: str) -> dict:
    """The plan file's JSON, checked field by field against the plan schema (``space.plan.plan_problems``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TensorOptError(f"--plan {path}: not a readable plan file ({first_line(exc)})") from None
    if problems := plan_problems(data):
        raise TensorOptError(f"--plan {path}: not a valid plan: {'; '.join(problems)}")
    return data


def check_counts(device: str | None, gpus: int | None, nnodes: int, master_port: int | None, min_gpus: int,
                 elastic: bool) -> None:
    """Device counts within sane bounds, and the plan port (``--master-port + 1``) a port."""
    problems = []
    if gpus is not None and gpus * nnodes > MAX_DEVICES:
        problems.append(f"--gpus {gpus} x --nnodes {nnodes} is more than {MAX_DEVICES:,} devices")
    if device == "cpu" and gpus is not None and gpus > MAX_CPU_WORKERS:
        problems.append(f"--device cpu --gpus {gpus}: at most {MAX_CPU_WORKERS} CPU workers on one host")
    if nnodes > 1 and master_port is not None and master_port >= MAX_PORT:
        problems.append(f"--master-port {master_port}: node 0 serves its plan on --master-port + 1, so give a port "
                        f"below {MAX_PORT}")
    if elastic and gpus is not None and min_gpus > gpus:
        problems.append(f"--min-gpus {min_gpus} is more than --gpus {gpus}: the job could never start")
    if problems:
        raise TensorOptError("; ".join(problems))


def check_mem_per_gpu(device: str | None, gpus: int | None, mem_per_gpu: str | None) -> float | None:
    """``--mem-per-gpu`` in bytes (None: not given); CPU workers share the host, so all of theirs must fit it."""
    if mem_per_gpu is None:
        return None
    size = parse_bytes(mem_per_gpu, "--mem-per-gpu")
    if device == "cpu" and gpus:
        host = memory_bytes("cpu")
        if size * gpus > host:
            raise TensorOptError(f"--mem-per-gpu {mem_per_gpu} x {gpus} CPU workers is more than this host's "
                                 f"{host / 2**30:.1f} GiB: give at most {host / gpus / 2**30:.2f} GiB")
    return size


def check_paths(run_dir: str, checkpoint_dir: str | None, resources_file: str | None, elastic: bool,
                min_gpus: int = 1) -> None:
    """The run and checkpoint folders writable (created later if missing), the resources file readable now and
    naming at least ``--min-gpus`` devices (else the job could not start)."""
    check_output_dir(run_dir, "--run-dir")
    if checkpoint_dir:
        check_output_dir(checkpoint_dir, "--checkpoint-dir")
    if resources_file and not elastic:
        raise TensorOptError("--resources is watched by an --elastic job only: add --elastic or drop --resources")
    if resources_file and (count := read_resources(Path(resources_file), 1.0).count) < min_gpus:
        raise TensorOptError(f"elastic: --resources {resources_file} names {count} devices, fewer than --min-gpus "
                             f"{min_gpus}: giving up")


__all__ = ["MAX_CPU_WORKERS", "check_counts", "check_mem_per_gpu", "check_paths", "read_plan"]
