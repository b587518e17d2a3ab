"""Rows of ``memory_accuracy.py`` for the torch engine: rank 0's step simulated on fake tensors beside the cost
model's prediction of the same plan (issue 19 part 5).

Each row is one ``tensoropt launch examples/train_llama_large.py --plan PLAN --dry-run --check-memory`` (the
launcher captures the script in the plan's precision, prices the plan with ``tensoropt.cost.model.estimate`` and
simulates rank 0's second step through the torch engine's own ``apply``: ``runtime.memory_check.simulate``), so
the prediction is the library's own pricing and the peak is what the engine holds, at real scale on a CPU:
a Llama-3-8B-like model on 8 devices for every family, LLaMA-2 70B on 64 for the plans the planner chooses there.
``--quick`` keeps the 8B dimensions with 4 layers.

``actual_bytes`` is rank 0's simulated peak of tensor bytes (``memory_tracker.StepMemory``); rank 0 holds the
largest share (the loose ops' parameters, the first vocabulary shard) in every plan here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "examples/train_llama_large.py"
# Llama 3 8B (Meta 2024: 32 layers, hidden 4096, 32 heads in 8 key/value groups, SwiGLU 14336, vocabulary
# 128256), 4096 tokens
LLAMA3_8B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn", "14336",
             "--vocab", "128256", "--seq-len", "4096"]
ON_8 = ["--device", "cuda", "--gpus", "8", "--profile", "h200-141gb"]     # DDP of an 8B model needs ~97 GiB
ON_64 = ["--device", "cuda", "--gpus", "8", "--nnodes", "8", "--profile", "h200-141gb"]


def _chain(spec: str, layers: int) -> tuple[tuple[LayerStrategy, int], ...]:
    """``"none"``, ``"full+sp"`` or a mix ``"5/16 none+sp, full+sp"`` (the first share of the copies, the rest)
    as (strategy, copies) pairs over ``layers`` copies."""
    def strategy(word: str) -> LayerStrategy:
        recompute, _, sp = word.strip().partition("+")
        return LayerStrategy(recompute, sp == "sp")
    if "," not in spec:
        return ((strategy(spec), layers),)
    first, rest = spec.split(",")
    share, word = first.split()
    numerator, denominator = map(int, share.split("/"))
    n = layers * numerator // denominator
    return ((strategy(word), n), (strategy(rest), layers - n))


def plan_of(devices: int, dp: int, tp: int, zero: int, micro_batch: int, global_batch: int, precision: str,
            chain: str, layers: int) -> Plan:
    """A torch-engine plan of the example's one block (``layers.*``) with the named precision."""
    return Plan(devices=devices, dp=dp, tp=tp, pp=1, micro_batch=micro_batch, global_batch=global_batch, zero=zero,
                tp_branches=("attn", "mlp") if tp > 1 else (), precision=precision,
                dtype="float32" if precision == "32-true" else "bfloat16", master_weights=False,
                blocks=(BlockPlan("layers.*", _chain(chain, layers)),))


def _dtype_args(precision: str) -> list[str]:
    """The script builds its weights in the dtype the precision keeps (float32 under bf16-mixed)."""
    return ["--dtype", "bfloat16" if precision == "bf16-true" else "float32"]


# (family, model, devices, dp, tp, zero, micro-batch, global batch, precision, chain)
CASES_8B = [
    ("ddp", 8, 8, 1, 0, 1, 8, "bf16-true", "none"),
    ("ddp-accumulation", 8, 8, 1, 0, 1, 16, "bf16-true", "none"),
    ("fsdp2-zero1", 8, 8, 1, 1, 1, 16, "bf16-true", "none"),
    ("fsdp2-zero2", 8, 8, 1, 2, 1, 16, "bf16-true", "none"),
    ("fsdp2-zero3", 8, 8, 1, 3, 1, 16, "bf16-true", "none"),
    ("tp2", 8, 4, 2, 3, 1, 8, "bf16-true", "none"),
    ("tp2-sp", 8, 4, 2, 3, 1, 8, "bf16-true", "none+sp"),
    ("recompute-none", 8, 8, 1, 3, 2, 16, "bf16-true", "none"),
    ("recompute-selective", 8, 8, 1, 3, 2, 16, "bf16-true", "selective"),
    ("recompute-full", 8, 8, 1, 3, 2, 16, "bf16-true", "full"),
    ("recompute-mixed", 8, 4, 2, 3, 2, 8, "bf16-true", "5/16 none+sp,full+sp"),
    ("precision-32-true", 8, 8, 1, 3, 1, 8, "32-true", "full"),
    ("precision-bf16-mixed", 8, 8, 1, 3, 1, 8, "bf16-mixed", "full"),
    ("precision-bf16-true", 8, 8, 1, 3, 1, 8, "bf16-true", "full"),
]
# LLaMA-2 70B on 64: the plan the planner chose with --engine torch (README, --check-memory), and ZeRO 3 with SP
# and no recomputation (priced on the h200-141gb profile: it needs more than 80 GiB)
CASES_70B = [
    ("fsdp2-zero3", 64, 32, 2, 3, 2, 64, "bf16-true", "25/80 none+sp,full+sp"),
    ("tp2-sp", 64, 32, 2, 3, 1, 64, "bf16-true", "none+sp"),
]


def check_memory(launch_args: list[str], script_args: list[str], plan: Plan, cache_dir: str) -> dict:
    """What ``launch --dry-run --check-memory`` wrote (``memory_check.json``: simulated and predicted)."""
    env = {**os.environ, "TENSOROPT_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "given.json"
        plan_file.write_text(json.dumps(plan.to_json()))
        result = subprocess.run([sys.executable, "-m", "tensoropt", "launch", SCRIPT, *launch_args, "--plan",
                                 str(plan_file), "--precision", plan.precision, "--dry-run", "--check-memory",
                                 "--run-dir", str(Path(tmp) / "run"), "--", *script_args],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        out = Path(tmp) / "run" / "memory_check.json"
        if result.returncode or not out.exists():
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"_memory_torch: {plan.summary()} failed: {tail}")
        return json.loads(out.read_text())


def _row(family: str, model: str, plan: Plan, check: dict) -> dict:
    simulated, predicted = check["simulated"], check["predicted"]
    return {"family": family, "model": model, "plan": plan.summary(), "precision": plan.precision,
            "how": "simulated", "actual_of": "rank 0",
            "predicted_tensor_bytes": int(predicted["tensor_bytes"]), "actual_bytes": int(simulated["peak_bytes"]),
            "predicted": predicted, "actual": simulated}


def rows(quick: bool = False, family: str | None = None) -> list[dict]:
    """One row per case (module doc); ``family``: only that family's cases."""
    layers = 4 if quick else 32
    model_8b = "llama3-8b-like" + (" (4 layers)" if quick else "")
    script_8b = LLAMA3_8B[:1] + [str(layers)] + LLAMA3_8B[2:]
    todo = [(c, model_8b, ON_8, script_8b, layers) for c in CASES_8B]
    if not quick:
        todo += [(c, "llama2-70b", ON_64, [], 80) for c in CASES_70B]
    todo = [t for t in todo if not family or t[0][0] == family]
    with tempfile.TemporaryDirectory() as cache_dir, ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(lambda t: _case(*t, cache_dir), todo))


WORKERS = 2          # simulations at once (each its own process)


def _case(case: tuple, model: str, launch: list[str], script_args: list[str], layers: int, cache_dir: str) -> dict:
    name, devices, dp, tp, zero, mb, gb, precision, chain = case
    plan = plan_of(devices, dp, tp, zero, mb, gb, precision, chain, layers)
    check = check_memory(launch, [*script_args, *_dtype_args(precision), "--global-batch", str(gb)], plan,
                         cache_dir)
    row = _row(name, model, plan, check)
    print(f"  {name:22s} {model:26s} {plan.summary():52s} {_ratio(row):+7.1%}", file=sys.stderr, flush=True)
    return row


def _ratio(row: dict) -> float:
    return row["predicted_tensor_bytes"] / row["actual_bytes"] - 1


__all__ = ["CASES_70B", "CASES_8B", "plan_of", "rows"]
