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

import dataclasses
import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from tensoropt.errors import TensorOptError, first_line
from tensoropt.graph.ir import OpGraph
from tensoropt.options import MAX_DEVICES
from tensoropt.runtime import RUN_DIR_ENV
from tensoropt.runtime.checkpoint.files import KEEP, latest_step
from tensoropt.search.engines import CHECKPOINTS
from tensoropt.search.limits import NO_LIMITS, Limits
from tensoropt.units import parse_bytes

from . import launch as L
from .checkpoints import check_room, checkpoint_env
from .gpus import gpu_count
from .workers import STOP_WAIT_S, clear_failure_notes, failure_note, kill_tree, stop_tree

POLL_S = 0.5
MAX_SAME_FAILURE = 2          # the same failure at the same checkpoint this many times: give up


@dataclass(frozen=True)
class ElasticOptions:
    checkpoint_dir: Path
    checkpoint_every: int
    min_gpus: int
    resources_file: Path | None
    objective: str
    limits: Limits = NO_LIMITS       # the user's limits on the space, kept by every re-plan
    max_gpus: int | None = None      # --gpus: never more devices than asked for, however many appear
    keep: int = KEEP                 # --keep-checkpoints


@dataclass(frozen=True)
class Resources:
    count: int
    memory_bytes: float              # per device


def read_resources(path: Path, memory_bytes: float) -> Resources:
    """The resources file ``{"gpus": N, "mem_per_gpu": "8GiB"}`` (memory optional: ``memory_bytes``), or a
    one-line ``TensorOptError`` saying what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TensorOptError(f"--resources {path}: not a readable JSON file ({first_line(exc)})") from None
    gpus = data.get("gpus") if isinstance(data, dict) else None
    if not (isinstance(gpus, int) and not isinstance(gpus, bool) and 0 <= gpus <= MAX_DEVICES):
        got = first_line(json.dumps(data), 80)
        raise TensorOptError(f'--resources {path}: give {{"gpus": N}} with N the devices available now, 0 to '
                             f'{MAX_DEVICES:,} (optionally "mem_per_gpu": "8GiB"), got {got}')
    memory = parse_bytes(data["mem_per_gpu"], f"--resources {path}: mem_per_gpu") if "mem_per_gpu" in data \
        else memory_bytes
    return Resources(gpus, memory)


def resources(devices: L.Devices, resources_file: Path | None, last: Resources | None = None,
              max_gpus: int | None = None, echo: Callable[[str], None] | None = None) -> Resources:
    """The devices available now: the resources file if there is one (``read_resources``); else on GPUs
    ``launcher.gpus.gpu_count`` (what nvidia-smi lists that CUDA_VISIBLE_DEVICES leaves visible, one MIG
    instance at most, capped by ``max_gpus``: ``--gpus``; no CUDA context in the launcher) with the memory found
    at launch (free memory falls while the job itself runs, so it is no signal); else what the job was launched
    with. A file that cannot be read (or is caught half-written) keeps ``last``, said once in one line through
    ``echo``; with no ``last`` (the start) it is an error."""
    if resources_file is not None:
        try:
            return read_resources(resources_file, devices.memory_bytes)
        except TensorOptError as exc:
            if last is None:
                raise
            if echo is not None:
                echo(f"elastic: {exc}; keeping the last good value, {last.count} devices of "
                     f"{last.memory_bytes / 2**30:.1f} GiB")
            return last
    if devices.kind == "cuda" and (count := gpu_count(max_gpus)) is not None:
        return Resources(count, devices.memory_bytes)
    return Resources(devices.count, devices.memory_bytes)


def run_elastic(script: str, script_args: list[str], graph: OpGraph, devices: L.Devices, options: ElasticOptions,
                run_dir: Path, echo: Callable[[str], None]) -> int:
    """Supervise the job until it finishes (0) or cannot go on (one-line TensorOptError)."""
    oom_cap, have, event = float("inf"), resources(devices, options.resources_file, None, options.max_gpus), "start"
    previous, failures = "none", Counter()
    while True:
        count = have.count
        if count < options.min_gpus:
            raise TensorOptError(f"elastic: {event}; {count} devices left, fewer than --min-gpus {options.min_gpus}: "
                                 "giving up")
        now = dataclasses.replace(devices, count=count, memory_bytes=min(have.memory_bytes, oom_cap))
        point, engine, why, _ = L.plan_for(graph, now, count, options.objective, tuple(CHECKPOINTS), pipeline=False,
                                           limits=options.limits)
        if event == "start":
            echo(check_room(options.checkpoint_dir, point.plan, graph, options.keep, options.checkpoint_every))
        step = latest_step(options.checkpoint_dir)
        echo(f"elastic: {event}; plan {previous} -> {point.plan.summary()} on {count} devices of "
             f"{now.memory_bytes / 2**30:.1f} GiB; resuming from step {step}")
        previous = point.plan.summary()
        argv = L.torchrun_argv(script, script_args, count)
        plan_file = L.write_plan(run_dir, point, engine, why, argv, graph, now.kind)
        clear_failure_notes(run_dir)
        env = L.main_env(now, plan_file.resolve()) | {RUN_DIR_ENV: str(run_dir.resolve())} \
            | checkpoint_env(options.checkpoint_dir, options.checkpoint_every, options.keep)
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        changed = _wait(proc, devices, options, have, echo)
        if changed != have:
            stop_tree(proc)
            event = f"devices changed {count} -> {changed.count}" if changed.count != count else \
                f"memory per device changed {have.memory_bytes / 2**30:.1f} -> {changed.memory_bytes / 2**30:.1f} GiB"
            have = changed
            continue
        if proc.returncode == 0:
            echo(f"elastic: finished with plan {previous}")
            return 0
        failure = failure_note(run_dir)
        if (failure or {}).get("kind") == "checkpoint":  # a full disk, or checkpoints of another model: no retry helps
            raise TensorOptError(f"elastic: {failure['message']}")
        oom = (failure or {}).get("kind") == "oom"      # the worker's note: torchrun itself exits 1 on any failure
        if oom:
            event = f"out of memory at step {(failure or {}).get('step', '?')} (plan needed " \
                    f"{point.peak_memory_bytes / 2**30:.3f} GiB)"
            oom_cap = point.peak_memory_bytes * (1 - 1e-9)             # the next point needs strictly less
        else:
            event = f"workers failed with exit status {proc.returncode}"
        key = ("oom" if oom else "failure", previous, latest_step(options.checkpoint_dir))
        failures[key] += 1
        if failures[key] > MAX_SAME_FAILURE:
            raise TensorOptError(f"elastic: {event} again, {failures[key]} times without progress past step {key[2]}: "
                                 "giving up")


def _wait(proc: subprocess.Popen, devices: L.Devices, options: ElasticOptions, have: Resources,
          echo: Callable[[str], None] = print) -> Resources:
    """Wait for the workers to exit; return early with the new resources if they change. A resources file that
    turns bad is said once (until it changes again), not every poll.
    SIGINT/SIGTERM to the launcher stop the workers and end the job as a Ctrl-C does (one line, exit status 130).
    """
    said: set[str] = set()

    def once(line: str) -> None:
        if line not in said:
            said.add(line)
            echo(line)

    def forward(_signum, _frame):           # may run inside proc.poll(): kill and wait without Popen's lock
        psutil.wait_procs(kill_tree(proc.pid), timeout=STOP_WAIT_S)
        raise KeyboardInterrupt
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            if (now := resources(devices, options.resources_file, have, options.max_gpus, once)) != have:
                return now
        return have
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
