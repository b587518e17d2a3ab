"""How well the cost model predicts real runs: step time and peak memory per worker on the CPU.

Each row trains a GPT-style model (benchmarks/train_probe.py) for a few steps under
``tensoropt launch --device cpu --gpus N --plan PLAN.json`` with the torch engine (DDP, FSDP2 ZeRO 2/3,
full recomputation, gradient accumulation) and compares what it measured with what the cost model
predicts for exactly that plan and that model: the graph is the launcher's own capture of the
script (same arguments), priced with the committed profile ``profiles/cpu-2core.json`` on a
cluster of N CPU devices on one node, as ``launcher.launch.plan_for`` does. Each plan is predicted
twice: with the profile alone (the roofline from its measured FLOP rates and bandwidths), and with the
profile plus per-op calibration: the forward and backward times of the captured graph's unique ops
measured on this machine (``tensoropt.profiler.run.calibrate_ops``, what ``tensoropt profile --model``
stores in a profile's ``op_times``), timed once per model in this process with one thread, as a
worker runs.

- Time: the median over the timed steps (after warm-up) of the slowest rank's step.
- Memory: the peak of live tensor bytes on the worker (torch's MemTracker) against the model's
  tensor terms (weights, gradients, optimizer states, activations, transient). The profile's fixed
  ``runtime_overhead_bytes`` (allocator slack and runtime, 512 MiB on this profile) is left out of
  both: a tensor tracker cannot see it. Peak RSS is recorded for context.
- Precision: the workers train in float32, so the plans say ``dtype: float32`` and the model sizes
  the model states as float32 training (4 + 4 + 8 bytes per parameter, no master copy).

    python benchmarks/cost_model_accuracy.py            # ~10 runs, a few minutes on 2 cores
    python benchmarks/cost_model_accuracy.py --quick    # 3 runs, to check the set-up

Timings depend on the machine being quiet. Before each calibration and each run the benchmark waits
(up to ``--max-wait`` seconds) until the other processes on the machine use less than
``QUIET_BUSY_CORES`` cores, and a run whose workers got less than ``UNDISTURBED_CPU_OVER_WALL`` of
their wall time on a core is repeated (up to ``ATTEMPTS`` runs, the least disturbed kept). Each row
records the cores in use before it, the load average, and the workers' CPU time over wall time;
the summary gives the errors over all rows and over the undisturbed ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import write_results
from _time_breakdown import breakdown, breakdown_table

from launcher.launch import capture_script
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, DeviceProfile, load_profile
from tensoropt.graph.fold import fold
from tensoropt.graph.ir import OpGraph
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

PROBE = Path(__file__).resolve().parent / "train_probe.py"
PROFILE = "cpu-2core"
OUT_ENV = "TENSOROPT_PROBE_OUT"          # train_probe.py writes rank<r>.json there
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

QUIET_BUSY_CORES = 0.3                 # what other processes may use of the cores for a quiet machine
UNDISTURBED_CPU_OVER_WALL = 0.75      # below: the workers waited for a core (gloo's own waits cost less)
ATTEMPTS = 3

# name: (hidden, layers, heads, seq_len, vocab, global_batch)
MODELS = {
    "gpt-h256-l4": (256, 4, 4, 128, 2048, 8),
    "gpt-h384-l6": (384, 6, 6, 256, 4096, 8),
    "gpt-h512-l8": (512, 8, 8, 256, 4096, 8),
}


@dataclass(frozen=True)
class Case:
    """One measured run: a model, a worker count and the plan's choices."""

    model: str
    workers: int
    zero: int = 0
    micro_batch: int = 8
    recompute_copies: int = 0          # block copies with full recomputation (the first ones)

    @property
    def label(self) -> str:
        return f"{self.model} x{self.workers}"


CASES = [
    Case("gpt-h256-l4", 1, micro_batch=8),
    Case("gpt-h256-l4", 2, zero=0, micro_batch=4),
    Case("gpt-h256-l4", 2, zero=3, micro_batch=4),
    Case("gpt-h384-l6", 1, micro_batch=8),
    Case("gpt-h384-l6", 1, micro_batch=2),
    Case("gpt-h384-l6", 2, zero=2, micro_batch=2),
    Case("gpt-h384-l6", 2, zero=0, micro_batch=4, recompute_copies=6),
    Case("gpt-h512-l8", 1, micro_batch=4, recompute_copies=4),
    Case("gpt-h512-l8", 2, zero=0, micro_batch=4),
    Case("gpt-h512-l8", 2, zero=3, micro_batch=2, recompute_copies=8),
]
QUICK = [CASES[0], CASES[1], CASES[2]]
BREAKDOWN = Case("gpt-h384-l6", 1, micro_batch=8)     # where one worker's time goes, op group by op group


def probe_args(model: str, steps: int, warmup: int) -> list[str]:
    hidden, layers, heads, seq_len, vocab, batch = MODELS[model]
    return ["--hidden", str(hidden), "--layers", str(layers), "--heads", str(heads), "--seq-len", str(seq_len),
            "--vocab", str(vocab), "--global-batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]


def tensoropt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensoropt", *args], capture_output=True, text=True, env=ENV,
                          timeout=600)


def dry_run_plan(script_args: list[str], workers: int, run_dir: Path) -> Plan:
    """The plan the launcher itself would choose (its mesh, block names, global batch): the base
    every case's plan is derived from."""
    result = tensoropt("launch", str(PROBE), "--device", "cpu", "--gpus", str(workers), "--run-dir", str(run_dir),
                       "--dry-run", "--", *script_args)
    if result.returncode:
        raise RuntimeError(f"dry run failed: {result.stderr[-2000:]}")
    return Plan.from_json(json.loads((run_dir / "plan.json").read_text()))


def case_plan(base: Plan, case: Case) -> Plan:
    """The case's choices on the dry run's plan (data parallel only), in float32 (what the CPU workers
    train in: 32-true, no master copy) on the torch engine, as ``launch`` runs it (``--engine torch``): the dry run
    chose its own precision and engine (bf16-mixed on DeepSpeed), whose states and buffers are not the run's."""
    (block,) = base.blocks
    copies = block.copies
    strategies = tuple((LayerStrategy(r), n) for r, n in (("full", case.recompute_copies),
                                                            ("none", copies - case.recompute_copies)) if n)
    return dataclasses.replace(base, dp=case.workers, tp=1, pp=1, virtual_stages=1, tp_branches=(), zero=case.zero,
                               micro_batch=case.micro_batch, dtype="float32", precision="32-true",
                               master_weights=False, engine="torch", grad_dtype="",
                               blocks=(BlockPlan(block.block, strategies),))


def predict(graph: OpGraph, plan: Plan, profile: DeviceProfile) -> dict:
    """The cost model's what-if of the plan for the script's own captured graph."""
    est = estimate(ModelCost(graph, fold(graph), Cluster(plan.devices, plan.devices, profile)), plan)
    tensor_bytes = est.peak_memory_bytes - profile.runtime_overhead_bytes
    return {"iteration_time_s": est.iteration_time_s, "peak_memory_bytes": est.peak_memory_bytes,
            "tensor_bytes": tensor_bytes, "runtime_overhead_bytes": profile.runtime_overhead_bytes,
            "memory_breakdown": est.memory_breakdown, "time_breakdown": est.time_breakdown}


@dataclass(frozen=True)
class Calibrated:
    """The profile with a model's unique ops timed on this machine, and how that went."""

    profile: DeviceProfile
    timed_ops: int
    skipped_ops: int
    seconds: float
    load_average: float


def calibrate(graph: OpGraph, profile: DeviceProfile, max_wait_s: float = 0.0) -> Calibrated:
    """Per-op calibration of the captured graph, as ``tensoropt profile --model`` does for a built-in
    model: each unique op (every block's template once, and the ops between blocks) forward and
    backward at the captured shapes, on one thread (a worker's setting: one core each)."""
    import torch

    from tensoropt.profiler.run import Settings, calibrate_ops
    folded = fold(graph)
    ops = {op.key(): op for op in [op for b in folded.blocks for op in b.ops] + list(folded.loose_ops)}
    wait_for_quiet(max_wait_s)
    threads, load, start = torch.get_num_threads(), os.getloadavg()[0], time.perf_counter()
    torch.set_num_threads(1)
    try:
        times, skipped = calibrate_ops([(op, key) for key, op in ops.items()], Settings("cpu", 2, quick=False),
                                       advance=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    op_times = tuple((key, fwd, bwd) for key, (fwd, bwd) in sorted(times.items()))
    return Calibrated(dataclasses.replace(profile, op_times=op_times), len(times), skipped,
                      time.perf_counter() - start, load)


def launch(script_args: list[str], plan: Plan, workers: int, tmp: Path) -> list[dict]:
    """Run the plan for real; each rank's measurements."""
    plan_path, out = tmp / "plan.json", tmp / "out"
    plan_path.write_text(json.dumps(plan.to_json()))
    result = subprocess.run([sys.executable, "-m", "tensoropt", "launch", str(PROBE), "--device", "cpu", "--gpus",
                             str(workers), "--plan", str(plan_path), "--engine", "torch", "--precision",
                             plan.precision or "32-true", "--run-dir",
                             str(tmp / "run"), "--", *script_args], capture_output=True, text=True,
                            env={**ENV, OUT_ENV: str(out)}, timeout=600)
    if result.returncode:
        raise RuntimeError(f"launch of {plan.summary()} failed: {result.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(workers)]


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]                       # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(interval_s: float = 2.0) -> float:
    """Cores in use by all processes over the next ``interval_s`` seconds."""
    busy0, total0 = _cpu_ticks()
    time.sleep(interval_s)
    busy1, total1 = _cpu_ticks()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(total1 - total0, 1)


def wait_for_quiet(max_wait_s: float) -> float:
    """Wait until the machine is quiet (other processes under ``QUIET_BUSY_CORES`` cores) or
    ``max_wait_s`` has passed; the cores in use at the end. Another process on one of the two cores
    doubles a two-worker step (each worker has one core), so a measurement needs the machine alone."""
    deadline = time.monotonic() + max_wait_s
    while (busy := busy_cores()) >= QUIET_BUSY_CORES and time.monotonic() < deadline:
        time.sleep(3.0)
    return busy


def measured(ranks: list[dict]) -> dict:
    """Slowest rank per step, median over steps; the largest peak over ranks (what the model predicts)."""
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(len(ranks[0]["step_times_s"]))]
    cpu = statistics.median(r["median_step_cpu_s"] / r["median_step_s"] for r in ranks)
    peak = max(ranks, key=lambda r: r["peak_memory_bytes"])
    return {"step_s": statistics.median(per_step), "step_times_s": per_step, "cpu_over_wall": cpu,
            "peak_tensor_bytes": peak["peak_memory_bytes"], "memory_breakdown": peak["memory_breakdown_bytes"],
            "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks), "plan": ranks[0]["plan"]}


def run_least_disturbed(script_args: list[str], plan: Plan, workers: int, tmp: Path, max_wait_s: float) -> dict:
    """Run the plan after waiting for a quiet machine, again while the workers were kept from their
    cores (CPU/wall under ``UNDISTURBED_CPU_OVER_WALL``), up to ``ATTEMPTS`` runs; the least disturbed."""
    best = None
    for attempt in range(1, ATTEMPTS + 1):
        busy, load = wait_for_quiet(max_wait_s), os.getloadavg()[0]
        start = time.perf_counter()
        try:
            ranks = launch(script_args, plan, workers, tmp)
        except RuntimeError as exc:          # on a shared machine a worker may be killed from outside: retry once
            print(f"retrying {plan.summary()}: {str(exc).splitlines()[0][:200]}", flush=True)
            ranks = launch(script_args, plan, workers, tmp)
        got = measured(ranks) | {"busy_cores_before": busy, "load_average_before": load, "attempts": attempt,
                                 "run_seconds": time.perf_counter() - start}
        if best is None or got["cpu_over_wall"] > best["cpu_over_wall"]:
            best = got
        if got["cpu_over_wall"] >= UNDISTURBED_CPU_OVER_WALL:
            break
    best["attempts"] = attempt
    return best


def run_case(case: Case, steps: int, warmup: int, bases: dict, calibrations: dict, max_wait_s: float) -> dict:
    script_args = probe_args(case.model, steps, warmup)
    graph, profile = capture_script(str(PROBE), script_args), load_profile(PROFILE)
    if case.model not in calibrations:
        calibrations[case.model] = calibrate(graph, profile, max_wait_s)
    calibrated = calibrations[case.model]
    with tempfile.TemporaryDirectory() as tmp:
        key = (case.model, case.workers)
        if key not in bases:
            bases[key] = dry_run_plan(script_args, case.workers, Path(tmp) / "dry")
        plan = case_plan(bases[key], case)
        predicted, with_ops = predict(graph, plan, profile), predict(graph, plan, calibrated.profile)
        got = run_least_disturbed(script_args, plan, case.workers, Path(tmp), max_wait_s)
    return {"model": case.model, "workers": case.workers, "plan": plan.summary(), "ran": got.pop("plan"),
            "measured_step_s": got["step_s"],
            "predicted_step_s": predicted["iteration_time_s"],
            "time_error": predicted["iteration_time_s"] / got["step_s"] - 1,
            "calibrated_step_s": with_ops["iteration_time_s"],
            "calibrated_time_error": with_ops["iteration_time_s"] / got["step_s"] - 1,
            "predicted_tensor_bytes": predicted["tensor_bytes"], "measured_tensor_bytes": got["peak_tensor_bytes"],
            "memory_error": predicted["tensor_bytes"] / got["peak_tensor_bytes"] - 1,
            "disturbed": got["cpu_over_wall"] < UNDISTURBED_CPU_OVER_WALL,
            "predicted": predicted, "calibrated": with_ops, "measured": got,
            "calibration": {"timed_ops": calibrated.timed_ops, "skipped_ops": calibrated.skipped_ops,
                            "seconds": calibrated.seconds, "load_average_before": calibrated.load_average},
            "load_average_before": got["load_average_before"], "busy_cores_before": got["busy_cores_before"],
            "run_seconds": got["run_seconds"]}


def table(rows: list[dict]) -> str:
    lines = ["| model | plan | measured s/step | profile alone s/step | error | with op times s/step | error | "
             "predicted MiB | measured MiB | memory error | CPU/wall | cores busy before |", "|---|---|" + "---:|" * 10]
    for r in rows:
        lines.append(f"| {r['model']} | {r['plan']} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{r['time_error']:+.1%} | {r['calibrated_step_s']:.3f} | {r['calibrated_time_error']:+.1%} | "
                     f"{r['predicted_tensor_bytes'] / 2**20:.1f} | "
                     f"{r['measured_tensor_bytes'] / 2**20:.1f} | {r['memory_error']:+.1%} | "
                     f"{r['measured']['cpu_over_wall']:.2f}{' (disturbed)' if r['disturbed'] else ''} | "
                     f"{r['busy_cores_before']:.2f} |")
    return "\n".join(lines) + "\n"


FINDINGS = """
## What drives the remaining errors

Read with the breakdown above and the per-category breakdowns in the JSON (``predicted`` and
``calibrated`` against ``measured``; memory: MemTracker's Parameter, Gradient, Optstate, Activation,
Temp at the peak). Nearly every step-time prediction is still too fast.

This run against the one before it (commit f8f685f, median 8.0% with op times): the cost model priced
every run exactly as before (the profile-alone predictions are identical to the last digit; the search
and pricing were rewritten for speed with bit-identical results), and the measured steps moved by -10%
to +4% (noise between sessions on the same machine class). The headline moved to 12.0% because the
per-op calibration, re-measured in every run, came out 0-10% faster this time (gpt-h512-l8 with ZeRO 2:
3.63 s calibrated then, 3.29 s now, for 3.44-3.58 s measured). That drift, not a model change, is the
difference: a single session's calibration is not yet reproducible to the 4 points the target needs.

What the cost model knows about this machine. ``profiles/cpu-2core.json`` says that eager CPU
kernels fuse nothing (``fuses_memory_bound_ops: false``) and that gloo reduces on the cores that
compute (``overlaps_communication: false``: data-parallel communication adds to the step). Its
links carry a bandwidth per collective, fitted from the profile's own measurements at the link's
latency: gloo's all-gather (0.34 GB/s) and reduce-scatter (0.32 GB/s) run at a third of its
all-reduce (1.05 GB/s). The op times are what ``tensoropt profile --model`` measures: the graph's
18 unique ops on one thread, forward and backward, now at 8 samples and stored per sample.

What changed in the run before this one (median 12.0% -> 8.0%, FSDP2 rows -32% to -52% before):
- Sharded data parallelism is priced as the engines run it: ZeRO 2 reduce-scatters every
  micro-batch and gathers the updated weights once per step (the torch engine now keeps FSDP2's
  parameters gathered across micro-batches, ``set_reshard_after_backward``), ZeRO 3 gathers twice
  and reduce-scatters in every micro-batch; layer by layer (a latency per block copy plus one for
  the loose ops), at the collective's own bandwidth, with a copy into or out of a flat buffer.
  FSDP2 rows: -52% -> -23% (h256, ZeRO 3), -35% -> -18% (h384, ZeRO 2), -32% -> -6% (h512, ZeRO 3).
- Autograd's own backward work is priced from the graph: the sums of gradients of a tensor that
  several ops read (residual stream, q/k/v) and the zero-filled whole-tensor gradients of slices
  (``slice_backward`` of the fused qkv projection): about 37 ms of the breakdown case's step.
- Ops are timed at 8 samples instead of one. At one sample their tensors sit in the core's 2 MiB
  L2 and small products run below their rate at the real size; timed at 8 the memory-bound ops
  come out 10-40% slower per sample, close to what they take inside a step. The breakdown case's
  forward "other" went from 0.38 to 0.64 of measured, its step from 0.84 to 0.94.
- The probe warms up 3 steps instead of 2: FSDP2's first steps were still settling.

One worker (-11% to +1%):
- Forward work the batch-1 graph does not have: at one sample the reshapes of the transposed q, k
  and v for the batched products are views, at 8 they are copies (``copy_``, ~51 ms of 1.54 s with
  the clones inside ``masked_fill``).
- Backward "other" is still 0.60 of measured: memory-bound gradient kernels run on freshly
  allocated tensors inside a step (page faults on the CPU), which a repeated timing of one op does
  not see.
- h256 is the furthest (-11%): its step is 0.26 s, so per-op framework time (autograd nodes,
  module calls) weighs more; the model prices 1 us per kernel.
- Calibration drifts between sessions more than within one: the previous committed run measured
  the breakdown case at 1.671 s and predicted 1.650 s from batch-1 op times; this session's first
  run (batch-1 times still) measured 1.510 s and predicted 1.307 s. Within a session repeated
  calibrations move a prediction by about 3-4%.

Two workers (-5% to -23%):
- DDP (-5% to -18%): the one-worker gaps, plus two workers sharing the socket's memory bandwidth
  (the ops were timed with the other core idle) and the reducer's own work.
- FSDP2 (-6% to -23%): the smallest model is the furthest: per unit, FSDP2's hooks, gradient
  casts and its buffers' allocation weigh most there.

How op times are measured (``tensoropt.profiler.ops.time_op``): the backward is ``autograd.grad``
through one recorded forward with output gradients made once (forward + backward minus forward
also timed making gradients and accumulating into ``.grad``, which is no part of the op). An op
whose output does not grow with the samples (a loss reduced to a scalar) is timed at its captured
shapes.

Memory (live tensor bytes, not RSS):
- The model counts weights, gradients, optimizer states and activations as all live at once. With
  one micro-batch the peak comes at the start of the backward, before any gradient exists, while
  the loss's backward temporaries (logit-sized gradients, "Temp") exist there and are not
  modelled. The two roughly cancel.
- DDP and FSDP2 (ZeRO 2/3) runs measure 4-17% more than predicted (ZeRO 3 also holds the gathered
  layer in flight and FSDP2's flat communication buffers); not broken down further yet.
"""


def _median_abs(rows: list[dict], key: str) -> tuple[float, float]:
    errors = [abs(r[key]) for r in rows] or [float("nan")]
    return statistics.median(errors), max(errors)


def _errors(rows: list[dict], what: str) -> str:
    calibrated, plain, memory = (_median_abs(rows, k) for k in ("calibrated_time_error", "time_error",
                                                                  "memory_error"))
    signed = statistics.median(r["calibrated_time_error"] for r in rows)
    return (f"{what}: step time {calibrated[0]:.1%} with the op times measured on this machine (max "
            f"{calibrated[1]:.1%}; signed median {signed:+.1%}), {plain[0]:.1%} with the profile alone (max "
            f"{plain[1]:.1%}); peak tensor memory {memory[0]:.1%} (max {memory[1]:.1%})")


def summary(rows: list[dict]) -> str:
    calm = [r for r in rows if not r["disturbed"]]
    groups = [(f"Median absolute error over all {len(rows)} runs", rows)]
    if 0 < len(calm) < len(rows):
        groups.append((f"over the {len(calm)} undisturbed runs", calm))
    for workers in (1, 2):
        subset = [r for r in calm if r["workers"] == workers]
        if subset:
            groups.append((f"undisturbed {workers}-worker runs ({len(subset)})", subset))
    ops = {r["model"]: r["calibration"] for r in rows}
    timed = ", ".join(f"{m} {c['timed_ops']} ops timed ({c['skipped_ops']} kept on the roofline) in "
                      f"{c['seconds']:.1f} s" for m, c in ops.items())
    return ("\n" + "; ".join(_errors(g, what) for what, g in groups) + ". Target: 10% each.\n\n"
            f"Calibration: {timed}. CPU/wall near 1 means the workers had their cores to themselves (gloo's "
            "waits for the other rank lower it a little); under "
            f"{UNDISTURBED_CPU_OVER_WALL}, marked disturbed, they waited for a core and the measured time is "
            "too long.\n")


def time_breakdown(case: Case, steps: int, warmup: int, rows: list[dict], calibrations: dict,
                   max_wait_s: float) -> dict:
    """Predicted (profile alone, and with op times) against measured time by phase and op group for
    one single-worker case."""
    import train_probe
    script_args = probe_args(case.model, steps, warmup)
    graph = capture_script(str(PROBE), script_args)
    row = next((r for r in rows if r["model"] == case.model and r["workers"] == 1), None)
    optimizer_s = row["predicted"]["time_breakdown"]["optimizer_s"] if row else 0.0
    calibrated = calibrations.get(case.model) or calibrate(graph, load_profile(PROFILE), max_wait_s)
    wait_for_quiet(max_wait_s)
    profiles = {"profile alone": load_profile(PROFILE), "with op times": calibrated.profile}
    return {"model": case.model, **breakdown(train_probe.parse_args(script_args), graph, profiles, case.micro_batch,
                                             optimizer_s, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three small runs")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-wait", type=float, default=300.0,
                        help="seconds to wait for a quiet machine before each measurement")
    args = parser.parse_args()
    rows, bases, calibrations = [], {}, {}
    for case in QUICK if args.quick else CASES:
        rows.append(run_case(case, args.steps, args.warmup, bases, calibrations, args.max_wait))
        r = rows[-1]
        print(f"{r['plan']:45s} {case.label:16s} time {r['measured_step_s']:.3f} s measured, predicted "
              f"{r['predicted_step_s']:.3f} ({r['time_error']:+.1%}), with op times {r['calibrated_step_s']:.3f} "
              f"({r['calibrated_time_error']:+.1%})  memory {r['predicted_tensor_bytes'] / 2**20:.1f}/"
              f"{r['measured_tensor_bytes'] / 2**20:.1f} MiB ({r['memory_error']:+.1%})  "
              f"CPU/wall {r['measured']['cpu_over_wall']:.2f}  busy before {r['busy_cores_before']:.2f}  "
              f"attempts {r['measured']['attempts']}", flush=True)
    split = time_breakdown(BREAKDOWN, args.steps, args.warmup, rows, calibrations, args.max_wait)
    notes = (summary(rows) + f"\n## Where the time goes: {split['model']}, one worker, micro-batch "
             f"{split['micro_batch']}\n\n" + breakdown_table(split) + FINDINGS)
    print(notes)
    write_results("cost_model_accuracy", rows, table(rows), notes, extra={"time_breakdown": split})


if __name__ == "__main__":
    main()
