"""Rows of ``memory_accuracy.py`` for pipeline plans: the first and last stages' ranks simulated on fake tensors
beside the cost model's prediction of the same plan (issue 19 part 5).

Each row is two ``tensoropt launch examples/train_llama_large.py --plan PLAN --dry-run --check-memory`` (one per
simulated rank): the launcher captures the script, prices the plan with ``tensoropt.cost.model.estimate`` and
simulates the rank's second step through the torch engine's own pipeline (``runtime.pipeline.stages``: stages built
with their messages' shapes, the real ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` run on a fake process group,
``runtime.memory.check``). The model is Llama-3-8B-like (32 layers, hidden 4096, 4096 tokens) on 8 devices;
``--quick`` keeps its dimensions with 8 layers (every case: 32 simulations, ~20-30 min on 2 busy cores).

``actual_bytes`` is the larger simulated peak of tensor bytes (``memory.tracker.StepMemory``) of rank 0 (stage 0:
the embedding, the most micro-batches in flight) and the last stage's first rank (the head and its logits,
``TENSOROPT_SIMULATE_RANK``): the stages between hold fewer micro-batches in flight and no loose ops. The tests
hold both ranks' simulation equal to a real 2-worker run's tracked peaks (``tests/test_memory_check.py``).

The simulations are stored in ``results/memory_pipeline.json`` (each row's case, layer count, both ranks' peaks,
the peak rank's breakdown and the commit it was simulated at): they depend on the runtime, not on the prices, so
``rows()`` re-prices them with the current cost model in seconds, priced in this process as ``launch --plan PLAN
--dry-run`` prices the plan. ``rows(simulate=True)`` (``--simulate`` here, ``memory_accuracy.py --simulate
_memory_pipeline``) simulates every case again: after a change to the runtime. A case not stored is simulated. The
32-layer cases are not stored (~45 minutes to simulate).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._common import check_memory, machine, memory_error, write_results  # noqa: E402
from launcher.capture import capture_script  # noqa: E402
from launcher.devices import detect  # noqa: E402
from launcher.launch import cost_model, price  # noqa: E402
from launcher.memory import predicted_breakdown  # noqa: E402
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan  # noqa: E402

STORED = REPO / "benchmarks" / "results" / "memory_pipeline.json"
SCRIPT = "examples/train_llama_large.py"
# Llama 3 8B (Meta 2024: 32 layers, hidden 4096, 32 heads in 8 key/value groups, SwiGLU 14336, vocabulary
# 128256), 4096 tokens
LLAMA3_8B = {"--layers": 32, "--hidden": 4096, "--heads": 32, "--kv-heads": 8, "--ffn": 14336, "--vocab": 128256,
             "--seq-len": 4096}
ON_8 = ["--device", "cuda", "--gpus", "8", "--profile", "h200-141gb"]     # 32-true without recomputation: ~93 GiB
GLOBAL_BATCH = 16

# (family, pp, virtual stages, dp, tp, zero, micro-batch, recompute, precision)
CASES = [
    ("pipeline-1f1b", 2, 1, 4, 1, 1, 1, "none", "bf16-true"),
    ("pipeline-1f1b", 4, 1, 2, 1, 1, 1, "none", "bf16-true"),
    ("pipeline-1f1b-full", 2, 1, 4, 1, 1, 1, "full", "bf16-true"),
    ("pipeline-1f1b-selective", 2, 1, 4, 1, 1, 1, "selective", "bf16-true"),
    ("pipeline-1f1b-ddp", 2, 1, 4, 1, 0, 1, "none", "bf16-true"),
    ("pipeline-1f1b-zero3", 2, 1, 4, 1, 3, 1, "full", "bf16-true"),
    ("pipeline-1f1b-zero3", 2, 1, 4, 1, 3, 1, "none", "bf16-true"),
    ("pipeline-1f1b-zero2", 2, 1, 4, 1, 2, 1, "none", "bf16-true"),
    ("pipeline-1f1b-tp2", 2, 1, 2, 2, 1, 1, "none", "bf16-true"),
    ("pipeline-1f1b-tp2", 2, 1, 2, 2, 3, 1, "full", "bf16-true"),
    ("pipeline-interleaved", 2, 2, 4, 1, 1, 1, "none", "bf16-true"),
    ("pipeline-interleaved", 4, 2, 2, 1, 1, 1, "full", "bf16-true"),
    ("pipeline-1f1b-bf16-mixed", 2, 1, 4, 1, 1, 1, "full", "bf16-mixed"),
    ("pipeline-1f1b-bf16-mixed", 2, 1, 4, 1, 1, 1, "none", "bf16-mixed"),
    ("pipeline-1f1b-bf16-mixed", 2, 1, 4, 1, 3, 1, "none", "bf16-mixed"),    # FSDP2's bf16 units on a stage
    ("pipeline-1f1b-bf16-mixed", 2, 1, 4, 1, 2, 1, "none", "bf16-mixed"),
    ("pipeline-1f1b-32-true", 2, 1, 4, 1, 1, 1, "full", "32-true"),
    ("pipeline-1f1b-32-true", 2, 1, 4, 1, 1, 1, "none", "32-true"),
]


def plan_of(pp: int, virtual: int, dp: int, tp: int, zero: int, micro_batch: int, recompute: str, precision: str,
            layers: int) -> Plan:
    """A torch-engine pipeline plan of the example's one block (``layers.*``) on ``pp * dp * tp`` devices."""
    return Plan(devices=pp * dp * tp, dp=dp, tp=tp, pp=pp, virtual_stages=virtual, micro_batch=micro_batch,
                global_batch=GLOBAL_BATCH, zero=zero, tp_branches=("attn", "mlp") if tp > 1 else (),
                precision=precision, dtype="float32" if precision == "32-true" else "bfloat16", master_weights=False,
                blocks=(BlockPlan("layers.*", ((LayerStrategy(recompute), layers // pp),)),))


def last_stage_rank(plan: Plan) -> int:
    """The first rank of the last pipeline stage (the engine's mesh is ``(pp, dp, tp)``, pipeline outermost)."""
    return (plan.pp - 1) * plan.dp * plan.tp


def _row(family: str, model: str, plan: Plan, checks: list[dict]) -> dict:
    """The row of the rank with the larger peak of the two simulated (the cost model prices a device as the larger
    of the first and the last stage: ``cost.model.evaluate_rows``)."""
    peak = max(checks, key=lambda check: check["simulated"]["peak_bytes"])
    simulated, predicted = peak["simulated"], peak["predicted"]
    ranks = {check["simulated"]["rank"]: check["simulated"]["peak_bytes"] for check in checks}
    return {"family": family, "model": model, "plan": plan.summary(), "precision": plan.precision,
            "how": "simulated", "actual_of": f"max over ranks {sorted(ranks)} (first and last pipeline stage)",
            "predicted_tensor_bytes": int(predicted["tensor_bytes"]), "actual_bytes": int(simulated["peak_bytes"]),
            "predicted": predicted, "actual": simulated, "actual_peak_by_rank": ranks}


def _dims(layers: int) -> list[str]:
    return [str(a) for k, v in (LLAMA3_8B | {"--layers": layers}).items() for a in (k, v)]


def script_args(layers: int, precision: str) -> list[str]:
    """The example's arguments for the Llama-3-8B-like model of ``layers`` layers in ``precision``."""
    dtype = "bfloat16" if precision == "bf16-true" else "float32"
    return [*_dims(layers), "--dtype", dtype, "--global-batch", str(GLOBAL_BATCH)]


def predicted(plan: Plan, layers: int) -> dict:
    """The cost model's breakdown of ``plan`` (``launcher.memory.predicted_breakdown``), priced in this process as
    ``tensoropt launch --plan PLAN --dry-run`` prices it (the capture cached like the launcher's)."""
    devices = detect("cuda", plan.devices, None, None, dry_run=True)
    graph = capture_script(SCRIPT, script_args(layers, plan.precision), precision=plan.precision)
    point = price(graph, devices, plan.devices, plan, "torch", plan.precision)
    return predicted_breakdown(cost_model(graph, devices, plan.devices, point.plan), point,
                               devices.profile.runtime_overhead_bytes)


def priced(row: dict) -> dict:
    """A stored row (its simulation) with the current cost model's prediction of its plan."""
    plan = plan_of(*row["case"][1:], row["layers"])
    got = predicted(plan, row["layers"])
    return row | {"predicted_tensor_bytes": int(got["tensor_bytes"]), "predicted": got}


def simulated(case: tuple, layers: int, model: str, cache_dir: str) -> dict:
    """A case's row with both simulated ranks (``actual``: the larger peak's breakdown; ``actual_by_rank``: each
    rank's) and the commit they were simulated at."""
    name, pp, virtual, dp, tp, zero, mb, recompute, precision = case
    plan = plan_of(pp, virtual, dp, tp, zero, mb, recompute, precision, layers)
    checks = [check_memory(SCRIPT, ON_8, script_args(layers, precision), plan, cache_dir,
                           {"TENSOROPT_SIMULATE_RANK": str(rank)}, timeout_s=1800)
              for rank in (0, last_stage_rank(plan))]
    return _row(name, model, plan, checks) | {"case": list(case), "layers": layers,
                                                 "simulated_at": machine()["commit"]}


def rows(quick: bool = False, family: str | None = None, simulate: bool = False) -> list[dict]:
    """One row per case (module doc); ``family``: only that family's cases. By default the simulations stored in
    ``results/memory_pipeline.json`` are re-priced with the current cost model (the simulations depend on the
    runtime, not on the prices; a case not stored there is simulated); ``simulate``: simulate every case again
    (~1 minute a rank at 8 layers on two cores)."""
    layers = 8 if quick else LLAMA3_8B["--layers"]
    model = "llama3-8b-like" + (f" ({layers} layers)" if quick else "")
    stored = {} if simulate or not STORED.exists() else \
        {(tuple(r["case"]), r["layers"]): r for r in json.loads(STORED.read_text())["rows"]}
    out = []
    # captures shared by the rows of one precision; a TENSOROPT_CACHE_DIR of the caller's keeps them
    with tempfile.TemporaryDirectory() as temporary:
        cache_dir = os.environ.get("TENSOROPT_CACHE_DIR", temporary)
        for case in CASES:
            if family and case[0] != family:
                continue
            found = stored.get((case, layers))
            out.append(priced(found) if found else _kept(simulated(case, layers, model, cache_dir)))
            print(f"  {case[0]:26s} {model:26s} {out[-1]['plan']:46s} {memory_error(out[-1]):+7.1%}"
                  f"{'' if found else ' (simulated)'}", file=sys.stderr, flush=True)
    return out


def _kept(row: dict) -> dict:
    """``row``, just simulated, stored at once in ``results/memory_pipeline.json`` (beside the rows there), so that
    a long run that stops later keeps what it simulated (the 32-layer rows take ~1-2 minutes each)."""
    data = json.loads(STORED.read_text()) if STORED.exists() else {"rows": []}
    key = (tuple(row["case"]), row["layers"])
    data["rows"] = [r for r in data["rows"] if (tuple(r["case"]), r["layers"]) != key] + [row]
    STORED.write_text(json.dumps(data, indent=1) + "\n")
    return row


def table(rows_: list[dict]) -> str:
    """The rows as a markdown table (GiB; the peak rank; predicted / actual - 1)."""
    lines = ["| family | plan | precision | peak rank | actual GiB | predicted GiB | error |",
             "|---|---|---|---|---:|---:|---:|"]
    for row in rows_:
        lines.append(f"| {row['family']} | {row['plan']} | {row['precision']} | {row['actual']['rank']} | "
                     f"{row['actual_bytes'] / 2**30:.3f} | {row['predicted_tensor_bytes'] / 2**30:.3f} | "
                     f"{memory_error(row):+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """``python benchmarks/_memory_pipeline.py [--quick] [--simulate]``: these rows alone, re-priced from the stored
    simulations (or simulated again), written to ``results/memory_pipeline.json`` and ``.md``
    (``memory_accuracy.py`` runs them with the other families)."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--simulate", action="store_true", help="simulate every case again (else re-price)")
    args = parser.parse_args()
    out = rows(args.quick, simulate=args.simulate)
    if STORED.exists():        # keep the stored rows of the other size (quick or not) that this run did not make
        made = {(tuple(r["case"]), r["layers"]) for r in out}
        out += [r for r in json.loads(STORED.read_text())["rows"] if (tuple(r["case"]), r["layers"]) not in made]
    write_results("memory_pipeline", out, table(out), notes=__doc__, extra={"quick": args.quick})


__all__ = ["CASES", "plan_of", "rows", "table"]


if __name__ == "__main__":
    main()
