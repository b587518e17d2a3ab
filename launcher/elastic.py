"""``tensoropt launch --elastic``: keep a job going while its resources change.

The launcher supervises one torchrun at a time. When the workers fail, run out of memory, or the
resources change (device count from the resources file, or the GPUs found), it stops them,
re-plans for what is there now (after an out-of-memory error: the next frontier point with less
memory), starts a fresh torchrun and the workers resume from the latest checkpoint, which
``torch.distributed.checkpoint`` reshards onto the new plan. Every torchrun is new (its own
rendezvous on a free port), so restarted gloo workers never meet the previous attempt's addresses
(the torchrun restart pitfall in ENVIRONMENT.md). Each decision is logged in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tensoropt.errors import TensorOptError
from tensoropt.graph.ir import OpGraph
from tensoropt.runtime import CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV
from tensoropt.runtime.checkpoint import latest_step
from tensoropt.runtime.run import OOM_EXIT_CODE, RUN_DIR_ENV

from . import launch as L

POLL_S = 0.5
MAX_SAME_FAILURE = 2          # the same failure at the same checkpoint this many times: give up


@dataclass(frozen=True)
class ElasticOptions:
    checkpoint_dir: Path
    checkpoint_every: int
    min_gpus: int
    resources_file: Path | None
    objective: str


def device_count(devices: L.Devices, resources_file: Path | None) -> int:
    """The devices available now: ``{"gpus": N}`` in the resources file if there is one, else the
    GPUs found (nvidia-smi, so the launcher never holds a CUDA context), else the count launched with."""
    if resources_file is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return int(json.loads(resources_file.read_text())["gpus"])
    if devices.kind == "cuda":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
            return sum(line.startswith("GPU ") for line in listed.splitlines())
    return devices.count


def checkpoint_env(checkpoint_dir: Path, every: int) -> dict:
    """What tells the workers' runtime where to checkpoint and resume from."""
    return {CHECKPOINT_DIR_ENV: str(checkpoint_dir.resolve()), CHECKPOINT_EVERY_ENV: str(every)}


def _failure(run_dir: Path) -> dict | None:
    """What a worker reported before it stopped (see tensoropt.runtime.run), if anything."""
    for path in sorted(run_dir.glob("failure-rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
    return None


def _stop(proc: subprocess.Popen) -> None:
    """Kill torchrun and its workers (one process group). Nothing after the last checkpoint is kept
    anyway, and a checkpoint being written when they die is never the one resumed from; SIGTERM
    would only make torchrun print a stack trace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_elastic(script: str, script_args: list[str], graph: OpGraph, devices: L.Devices, options: ElasticOptions,
                run_dir: Path, echo: Callable[[str], None]) -> int:
    """Supervise the job until it finishes (0) or cannot go on (one-line TensorOptError)."""
    memory_cap, count, event = devices.memory_bytes, device_count(devices, options.resources_file), "start"
    previous, failures = "none", Counter()
    while True:
        if count < options.min_gpus:
            raise TensorOptError(f"elastic: {event}; {count} devices left, fewer than --min-gpus {options.min_gpus}: "
                                 "giving up")
        now = dataclasses.replace(devices, count=count, memory_bytes=memory_cap)
        point, engine, why, _ = L.plan_for(graph, now, count, options.objective, "torch")
        step = latest_step(options.checkpoint_dir)
        echo(f"elastic: {event}; plan {previous} -> {point.plan.summary()} on {count} devices; resuming from step "
             f"{step}")
        previous = point.plan.summary()
        argv = L.torchrun_argv(script, script_args, count)
        plan_file = L.write_plan(run_dir, point, engine, why, argv, graph)
        for stale in run_dir.glob("failure-rank*.json"):
            stale.unlink()
        env = L.main_env(now, plan_file.resolve()) | checkpoint_env(options.checkpoint_dir, options.checkpoint_every) \
            | {RUN_DIR_ENV: str(run_dir.resolve())}
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        new_count = _wait(proc, devices, options.resources_file, count)
        if new_count != count:
            _stop(proc)
            event, count = f"devices changed {count} -> {new_count}", new_count
            continue
        if proc.returncode == 0:
            echo(f"elastic: finished with plan {previous}")
            return 0
        failure = _failure(run_dir)
        oom = proc.returncode == OOM_EXIT_CODE or (failure or {}).get("kind") == "oom"
        if oom:
            event = f"out of memory at step {(failure or {}).get('step', '?')} (plan needed " \
                    f"{point.peak_memory_bytes / 2**30:.3f} GiB)"
            memory_cap = point.peak_memory_bytes * (1 - 1e-9)          # the next point needs strictly less
        else:
            event = f"workers failed with exit status {proc.returncode}"
        key = ("oom" if oom else "failure", previous, latest_step(options.checkpoint_dir))
        failures[key] += 1
        if failures[key] > MAX_SAME_FAILURE:
            raise TensorOptError(f"elastic: {event} again, {failures[key]} times without progress past step {key[2]}: "
                                 "giving up")


def _wait(proc: subprocess.Popen, devices: L.Devices, resources_file: Path | None, count: int) -> int:
    """Wait for the workers to exit; return early with the new device count if it changes.
    SIGINT/SIGTERM to the launcher stop the workers and end the job."""
    def forward(signum, _frame):
        _stop(proc)
        raise TensorOptError(f"elastic: stopped by signal {signum}")
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            if (now := device_count(devices, resources_file)) != count:
                return now
        return count
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
