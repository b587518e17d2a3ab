"""Rows of ``benchmarks/memory_accuracy.py`` for the DeepSpeed engine: ZeRO 0-3 and optimizer offload, measured.

DeepSpeed cannot run on fake tensors (its partitioning and bucketed reductions read real storage and need a real
process group), so each row trains ``examples/train_gpt.py`` on two CPU workers through ``tensoropt launch
--engine deepspeed --plan`` with ``TENSOROPT_MEMORY_OUT``: every rank tracks its first two steps with the same
tracker as the simulations (``runtime.memory.check``; DeepSpeed's own flat buffers, partitions and buckets are
named by ``runtime.engines.deepspeed_tensors``) and writes the second step's peak by category. ``actual_bytes`` is the
larger of the two ranks' peaks. The prediction is the library's: ``cost.model.estimate`` of the same plan on the
captured graph (as ``tensoropt launch`` prices it), less the profile's ``runtime_overhead_bytes``.

Offload rows: on a CPU run the host and the "device" are one memory, so the tracker counts what DeepSpeed keeps on
the host too; it names it (``offloaded``: the float32 partitions, their gradients, the AdamW states, the host
staging buffers), and ``actual_bytes`` is the peak less those bytes: what a GPU would hold at that moment.

``python benchmarks/_memory_deepspeed.py`` measures every row and writes ``results/memory_deepspeed.json``;
``--reprice`` re-prices the rows stored there with the current cost model (the measurements do not depend on it),
as ``memory_accuracy.py`` does (``rows(measure=True)`` launches them again).

The model: a 12-layer GPT, hidden 512, vocabulary 8192, sequence 64 (42.1M parameters), global batch 8 in micro-
batches of 2 (two accumulation steps per rank), AdamW with its foreach kernels (``--foreach``, what CUDA runs by
default; the CPU's default is one tensor at a time), built on meta (``--meta``) so each rank materialises its own.
Model states dominate: 16 bytes per parameter are 640 MiB beside ~30 MiB of activations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import RESULTS  # noqa: E402
from launcher.capture import capture_script  # noqa: E402
from launcher.devices import detect  # noqa: E402
from launcher.launch import cost_model, planned_precision  # noqa: E402
from tensoropt.cost.model import estimate  # noqa: E402
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan  # noqa: E402

SCRIPT = str(ROOT / "examples" / "train_gpt.py")
LAYERS = 12
SCRIPT_ARGS = ["--hidden", "512", "--layers", str(LAYERS), "--heads", "8", "--vocab", "8192", "--seq-len", "64",
               "--global-batch", "8", "--meta", "--foreach"]
MODEL = "gpt 12x512, vocab 8192, seq 64 (42.1M parameters)"
DEVICES = 2
# (ZeRO stage, precision, recompute, offload): every stage in both precisions, offload as the planner offers it
# (ZeRO 1-3, search.engines), full recomputation under ZeRO 1 and 3
CASES = [(z, p, "none", False) for z in (0, 1, 2, 3) for p in ("bf16-mixed", "32-true")] + \
        [(z, "bf16-mixed", "none", True) for z in (1, 2, 3)] + \
        [(1, "bf16-mixed", "full", False), (3, "bf16-mixed", "full", False)]
QUICK = [(1, "bf16-mixed", "none", False), (3, "32-true", "full", False), (2, "bf16-mixed", "none", True)]


def plan_of(zero: int, precision: str, recompute: str, offload: bool) -> Plan:
    """dp2 on two workers, two micro-batches of 2 per rank, every layer with ``recompute``."""
    return Plan(devices=DEVICES, dp=DEVICES, tp=1, pp=1, micro_batch=2, global_batch=8, zero=zero, offload=offload,
                precision=precision, blocks=(BlockPlan("layers.*", ((LayerStrategy(recompute), LAYERS),)),))


def family(zero: int, offload: bool) -> str:
    return f"deepspeed-zero{zero}" + ("-offload" if offload else "")


def measured(plan: Plan, precision: str, run_dir: Path) -> dict:
    """The larger of the two ranks' tracked peaks (each rank's breakdown under ``ranks``)."""
    plan_file = run_dir / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    out = run_dir / "memory-{rank}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TENSOROPT_MEMORY_OUT": str(out)}
    argv = [sys.executable, "-m", "tensoropt", "launch", SCRIPT, "--device", "cpu", "--gpus", str(DEVICES), "--plan",
            str(plan_file), "--engine", "deepspeed", "--precision", precision, "--run-dir", str(run_dir / "run"), "--",
            *SCRIPT_ARGS, "--steps", "3"]
    result = subprocess.run(argv, cwd=run_dir, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"_memory_deepspeed: {plan.summary()} {precision} failed: {tail}")
    ranks = [json.loads(Path(str(out).replace("{rank}", str(r))).read_text()) for r in range(DEVICES)]
    return max(ranks, key=lambda r: r["peak_bytes"])


def predicted(plan: Plan, precision: str) -> tuple[int, dict]:
    """(tensor bytes, breakdown) the cost model gives the plan on DeepSpeed, as ``tensoropt launch`` prices it."""
    devices = detect("cpu", DEVICES, None)
    graph = capture_script(SCRIPT, SCRIPT_ARGS, precision=precision)
    plan = planned_precision(plan, "deepspeed", precision)
    result = estimate(cost_model(graph, devices, DEVICES, plan), plan)
    overhead = devices.profile.runtime_overhead_bytes
    return int(result.peak_memory_bytes - overhead), result.memory_breakdown | {"runtime_overhead_bytes": overhead}


def row(zero: int, precision: str, recompute: str, offload: bool) -> dict:
    plan = plan_of(zero, precision, recompute, offload)
    with tempfile.TemporaryDirectory() as tmp:
        actual = measured(plan, precision, Path(tmp))
    return priced({"family": family(zero, offload), "model": MODEL, "plan": plan.summary(), "precision": precision,
                   "recompute": recompute, "offload": offload, "zero": zero, "how": "measured",
                   "ranks": "max over both ranks (device bytes: the peak less what is offloaded to the host)",
                   "actual_bytes": int(actual["peak_bytes"] - actual.get("offloaded", 0)),
                   "actual": {k: v for k, v in actual.items() if k not in ("rank", "simulated")}})


def priced(r: dict) -> dict:
    """``r`` with the cost model's prediction of its plan (``predicted_tensor_bytes``, ``predicted``)."""
    plan = plan_of(r["zero"], r["precision"], r["recompute"], r["offload"])
    tensor_bytes, breakdown = predicted(plan, r["precision"])
    return r | {"predicted_tensor_bytes": tensor_bytes, "predicted": breakdown,
                "ratio": round(tensor_bytes / r["actual_bytes"] - 1, 4)}


def rows(quick: bool = False, measure: bool = False) -> list[dict]:
    """One row per case (``QUICK``: three of them). By default the measurements stored in
    ``results/memory_deepspeed.json`` (made by ``main``, ~1-2 minutes a launch on two cores) are re-priced with the
    current cost model: they depend on the runtime, not on the prices. ``measure``: launch every case again."""
    cases = QUICK if quick else CASES
    if measure:
        return [row(*case) for case in cases]
    stored = json.loads((RESULTS / "memory_deepspeed.json").read_text())["rows"]
    return [priced(r) for r in stored if (r["zero"], r["precision"], r["recompute"], r["offload"]) in cases]


def main() -> None:
    out = RESULTS / "memory_deepspeed.json"
    if "--reprice" in sys.argv:
        found = [priced(r) for r in json.loads(out.read_text())["rows"]]
    else:
        found = []
        for case in QUICK if "--quick" in sys.argv else CASES:
            found.append(row(*case))
            print(json.dumps(found[-1]), flush=True)
    out.write_text(json.dumps({"model": MODEL, "script_args": SCRIPT_ARGS, "rows": found}, indent=1) + "\n")
    lines = [f"# DeepSpeed memory, measured on two CPU workers ({MODEL})", "",
             "| family | precision | recompute | predicted tensor bytes | measured peak (max over ranks) | "
             "predicted / measured - 1 |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['family']} | {r['precision']} | {r['recompute']} | {r['predicted_tensor_bytes']:,} | "
              f"{r['actual_bytes']:,} | {r['ratio']:+.2%} |" for r in found]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
