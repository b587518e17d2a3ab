"""The cost model against real GPU trainings: predicted vs measured step time and peak memory.

Each case trains a model through ``tensoropt launch --plan`` on the visible GPUs (the plan is the
launcher's own dry-run choice, edited to the case's engine, ZeRO stage, recomputation and micro-batch)
and compares:
- step time: the median over the steps after the first two, against the launcher's prediction with the
  GPU's datasheet profile and, where this machine has one (``tensoropt profile --device cuda``, or
  ``--measured PATH``), with its measured profile;
- memory: ``torch.cuda.max_memory_allocated`` of rank 0 against the predicted peak, which must be an
  upper bound within 5% (predicted / measured in [1.00, 1.05]) for "fits" to mean fits.

Targets (issue 12): median |time error| <= 10% with the datasheet profile, <= 5% with a measured per-op
profile; memory within +0..+5%. Results go to ``results/gpu_accuracy.{md,json}`` (device, versions, date).
Without a GPU it says so in one line and exits 0; ``--device cpu`` runs tiny cases on 2 CPU workers to
check this script (time only: CPUs have no allocator peak; nothing is written).

    python benchmarks/gpu_accuracy.py [--measured PATH] [--steps 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _common import write_results
from _launch import launched, run

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GPT, LLAMA = str(REPO / "examples" / "train_gpt.py"), str(REPO / "examples" / "train_llama_large.py")
# (script, arguments) per model: GPU size, CPU size. GPT-3 1.3B's shape (explicit softmax attention) and a
# 1B LLaMA-style model (flash attention, RoPE, SwiGLU, grouped-query attention), both in bf16.
MODELS = {
    "gpt-1.3b": (GPT, ["--hidden", "2048", "--layers", "24", "--heads", "16", "--vocab", "50304", "--seq-len", "2048",
                       "--dtype", "bfloat16"],
                 ["--hidden", "64", "--layers", "4", "--seq-len", "32"]),
    "llama-1b": (LLAMA, ["--hidden", "2048", "--layers", "16", "--heads", "16", "--kv-heads", "8", "--ffn", "5632",
                         "--vocab", "32000", "--seq-len", "2048"],
                 ["--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab",
                  "128", "--seq-len", "32", "--dtype", "float32"]),
}


@dataclass(frozen=True)
class Case:
    model: str
    engine: str
    zero: int
    micro_batch: int
    recompute: str = "none"           # none | full, for every layer
    offload: bool = False


CASES = [Case("gpt-1.3b", "torch", 0, 8), Case("gpt-1.3b", "torch", 0, 4, "full"),
         Case("gpt-1.3b", "deepspeed", 1, 1, "full", offload=True), Case("gpt-1.3b", "deepspeed", 2, 4),
         Case("llama-1b", "torch", 0, 8), Case("llama-1b", "torch", 3, 4, "full"),
         Case("llama-1b", "deepspeed", 3, 4)]


def case_plan(base, case: Case, devices: int):
    """The dry run's plan with the case's choices (data parallel over every device)."""
    from tensoropt.space.plan import BlockPlan, LayerStrategy
    (block,) = base.blocks
    copies = sum(n for _, n in block.strategies) * base.pp
    return dataclasses.replace(base, dp=devices, tp=1, pp=1, virtual_stages=1, tp_branches=(), zero=case.zero,
                               offload=case.offload, micro_batch=case.micro_batch,
                               blocks=(BlockPlan(block.block, ((LayerStrategy(case.recompute), copies),)),))


def measure(case: Case, args, tmp: Path, env: dict) -> dict:
    """Train the case's plan; its measurements and the launcher's prediction."""
    from tensoropt.space.plan import Plan
    script, gpu_args, cpu_args = MODELS[case.model]
    model_args = [*(gpu_args if args.gpu else cpu_args), "--global-batch", str(args.global_batch)]
    devices = ["--gpus", str(args.gpus), *([] if args.gpu else ["--device", "cpu"])]
    dry = tmp / f"dry-{case.model}"
    run([sys.executable, "-m", "tensoropt", "launch", script, *devices, "--dry-run", "--run-dir", str(dry), "--",
         *model_args], str(tmp), env)
    plan = case_plan(Plan.from_json(json.loads((dry / "plan.json").read_text())), case, args.gpus)
    plan_file = tmp / f"{case.model}-{case.engine}-z{case.zero}-mb{case.micro_batch}-{case.recompute}.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    launch_args = [*devices, "--plan", str(plan_file), "--engine", case.engine,
                   *(["--profile", args.datasheet] if args.datasheet else [])]
    data = launched(script, launch_args, [*model_args, "--steps", str(args.steps)], tmp / plan_file.stem, env)
    data["script"], data["model_args"], data["plan_object"] = script, model_args, plan
    return data


def measured_prediction(data: dict, case: Case, args, measured: str) -> float:
    """The same plan priced with the measured profile (the run itself is the same)."""
    from launcher.capture import capture_script
    from launcher.devices import Devices
    from launcher.launch import price
    from tensoropt.cost.profile import load_profile
    profile = load_profile(measured)
    graph = capture_script(data["script"], data["model_args"])
    devices = Devices("cuda" if args.gpu else "cpu", args.gpus, profile.memory_bytes, profile, measured)
    return price(graph, devices, args.gpus, data["plan_object"], case.engine).iteration_time_s


def row(case: Case, data: dict, measured_s: float | None) -> dict:
    times = data["step_times_s"][2:] or data["step_times_s"]
    step = statistics.median(times)
    predicted = data["predicted"]
    peak = data["max_memory_allocated_bytes"]
    return {"model": case.model, "engine": case.engine, "plan": data["plan"], "precision": predicted["precision"],
            "measured_step_s": step, "predicted_step_s": predicted["iteration_time_s"],
            "time_error": predicted["iteration_time_s"] / step - 1,
            "predicted_step_measured_profile_s": measured_s,
            "time_error_measured_profile": None if measured_s is None else measured_s / step - 1,
            "max_memory_allocated_bytes": peak, "predicted_memory_bytes": predicted["peak_memory_bytes"],
            "memory_ratio": None if peak is None else predicted["peak_memory_bytes"] / peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpus", type=int, default=None, help="default: every GPU visible (2 CPU workers)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--datasheet", default=None, help="the datasheet profile (default: the GPU's own)")
    parser.add_argument("--measured", default=None, help="a measured profile (default: this machine's, if any)")
    args = parser.parse_args()
    import torch
    args.gpu = args.device == "cuda"
    if args.gpu and not torch.cuda.is_available():
        print("gpu_accuracy: no GPU visible (torch.cuda.is_available() is False): skipped; --device cpu checks the "
              "script on CPU workers")
        return
    from tensoropt.profiler.run import device_name
    from tensoropt.profiler.store import datasheet_profile, find_measured
    args.gpus = args.gpus or (torch.cuda.device_count() if args.gpu else 2)
    if args.gpu:
        args.datasheet = args.datasheet or datasheet_profile(torch.cuda.get_device_name(0))
    measured = args.measured or (str(path) if (path := find_measured(device_name(args.device))) else None)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for case in CASES:
            data = measure(case, args, Path(tmp_name), env)
            rows.append(row(case, data, measured_prediction(data, case, args, measured) if measured else None))
            print(json.dumps(rows[-1]), flush=True)
    table, notes = report(rows, args, measured)
    print(table + notes)
    if args.gpu:
        write_results("gpu_accuracy", rows, table, notes, {"device": torch.cuda.get_device_name(0),
                                                           "cuda": torch.version.cuda, "gpus": args.gpus})


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def report(rows: list[dict], args, measured: str | None) -> tuple[str, str]:
    table = ("| model | engine | plan | measured step (s) | predicted (s) | error | with measured profile | "
             "max allocated (GiB) | predicted (GiB) | predicted / allocated |\n"
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        peak = "-" if r["max_memory_allocated_bytes"] is None else f"{r['max_memory_allocated_bytes'] / 2**30:.2f}"
        ratio = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.3f}"
        table += (f"| {r['model']} | {r['engine']} | {r['plan']} | {r['measured_step_s']:.3f} | "
                  f"{r['predicted_step_s']:.3f} | {_pct(r['time_error'])} | {_pct(r['time_error_measured_profile'])} | "
                  f"{peak} | {r['predicted_memory_bytes'] / 2**30:.2f} | {ratio} |\n")
    median = statistics.median(abs(r["time_error"]) for r in rows)
    with_measured = [abs(r["time_error_measured_profile"]) for r in rows
                     if r["time_error_measured_profile"] is not None]
    ratios = [r["memory_ratio"] for r in rows if r["memory_ratio"] is not None]
    notes = (f"\nMedian |time error|: {100 * median:.1f}% with the {args.datasheet or 'cpu-2core'} profile (target "
             f"<= 10%)" + (f"; {100 * statistics.median(with_measured):.1f}% with {measured} (target <= 5%)"
                           if with_measured else "; no measured profile on this machine") +
             (f". Memory: predicted / allocated {min(ratios):.3f}-{max(ratios):.3f} (target 1.00-1.05)."
              if ratios else ". Memory: not measured on CPUs.") +
             f" {args.gpus} device(s), global batch {args.global_batch}, {args.steps} steps, the first two not "
             "timed.\n")
    return table, notes


if __name__ == "__main__":
    main()
