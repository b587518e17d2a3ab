"""Rows of ``memory_accuracy.py`` for the published recipes of ``_recipes.py`` (issue 33): each simulated at full size
on fake tensors and priced by the cost model, as the torch engine runs it in the launcher's default precision.

Each row is ``tensoropt launch benchmarks/preset_train.py --plan RECIPE --dry-run --check-memory`` for rank 0 and,
with pipeline stages, for the last stage's first rank (the head and its logits): the launcher captures the script,
prices the plan (``tensoropt.cost.model.estimate``) and simulates the rank's second step through the torch engine's
own ``apply`` on a fake process group of the recipe's world size (``runtime.memory.check``). ``actual_bytes`` is the
larger simulated peak of the two. Target (issue 33): every simulated peak at most 80 GiB (tensors only, as the
tracker counts them) and predicted within 0..+5% of it.

The simulations are stored in ``results/memory_recipes.json`` (with the commit they ran at): ``rows()`` re-prices
them with the current cost model; ``rows(simulate=True)`` (``memory_accuracy.py --simulate _memory_recipes``)
simulates them again, after a change to the runtime (minutes per rank on two cores: a GPT-3 175B stage of 12 layers
runs 64 micro-batches twice on fake tensors).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._common import check_memory, machine, memory_error  # noqa: E402
from benchmarks._recipes import RECIPES, SCRIPT, Recipe  # noqa: E402

STORED = REPO / "benchmarks" / "results" / "memory_recipes.json"
PRECISION = "bf16-mixed"                 # the launcher's default
LIMIT_BYTES = 80 * 2**30                 # "each simulated peak at most 80 GiB" (issue 33)


def _ranks(recipe: Recipe) -> tuple[int, ...]:
    """Rank 0 (stage 0: the embedding, the most micro-batches in flight) and the last stage's first rank (the engine's
    mesh is (pp, dp, tp), pipeline outermost)."""
    plan = recipe.plan(PRECISION)
    return (0,) if plan.pp == 1 else (0, (plan.pp - 1) * plan.dp * plan.tp)


def simulated(recipe: Recipe, cache_dir: str) -> dict:
    """The recipe's row: each rank's simulated peak, the larger one's breakdown, and the prediction."""
    plan = recipe.plan(PRECISION)
    # simulated on the h200-141gb profile: the launcher refuses a --plan its devices cannot hold, and a recipe that
    # does not fit 80 GiB is simulated all the same (the tensors simulated do not depend on the profile)
    launch = [a if a != "h100-80gb" else "h200-141gb" for a in recipe.launch_args()]
    checks = [check_memory(SCRIPT, launch, recipe.script_args(), plan, cache_dir,
                           {"TENSOROPT_SIMULATE_RANK": str(rank)}, timeout_s=3600) for rank in _ranks(recipe)]
    peak = max(checks, key=lambda check: check["simulated"]["peak_bytes"])
    return {"family": "recipe", "recipe": recipe.name, "model": recipe.model, "plan": plan.summary(),
            "precision": PRECISION, "how": "simulated",
            "predicted_tensor_bytes": int(peak["predicted"]["tensor_bytes"]),
            "actual_bytes": int(peak["simulated"]["peak_bytes"]), "predicted": peak["predicted"],
            "actual": peak["simulated"],
            "actual_peak_by_rank": {c["simulated"]["rank"]: c["simulated"]["peak_bytes"] for c in checks},
            "within_limit": peak["simulated"]["peak_bytes"] <= LIMIT_BYTES, "simulated_at": machine()["commit"]}


def priced(row: dict, recipe: Recipe, cache_dir: str) -> dict:
    """A stored row with the current cost model's prediction of its plan, priced as ``launch --plan --dry-run``."""
    os.environ["TENSOROPT_CACHE_DIR"] = cache_dir
    import dataclasses

    from launcher.capture import capture_script
    from launcher.devices import detect
    from launcher.launch import cost_model, price
    from launcher.memory import predicted_breakdown
    devices = detect("cuda", min(recipe.per_node, recipe.gpus), None, "h100-80gb", dry_run=True)
    devices = dataclasses.replace(devices, count=recipe.gpus)
    graph = capture_script(SCRIPT, recipe.script_args(), precision=PRECISION)
    point = price(graph, devices, recipe.per_node, recipe.plan(PRECISION), "torch", PRECISION)
    got = predicted_breakdown(cost_model(graph, devices, recipe.per_node, point.plan), point,
                              devices.profile.runtime_overhead_bytes)
    return row | {"predicted_tensor_bytes": int(got["tensor_bytes"]), "predicted": got}


def rows(quick: bool = False, family: str | None = None, simulate: bool = False) -> list[dict]:
    """One row per recipe with a memory row (module doc); ``quick``: none (every recipe is full size)."""
    if quick or (family and family != "recipe"):
        return []
    stored = {} if simulate or not STORED.exists() else {r["recipe"]: r for r in json.loads(STORED.read_text())["rows"]}
    out = []
    with tempfile.TemporaryDirectory() as temporary:
        cache_dir = os.environ.get("TENSOROPT_CACHE_DIR", temporary)
        for recipe in (r for r in RECIPES if r.memory_row):
            found = stored.get(recipe.name)
            row = priced(found or _kept(simulated(recipe, cache_dir)), recipe, cache_dir)
            out.append(row)
            print(f"  {recipe.name:16s} {row['plan']:62s} {row['actual_bytes'] / 2**30:7.2f} GiB simulated "
                  f"{memory_error(row):+7.1%}{'' if found else ' (simulated)'}", file=sys.stderr, flush=True)
    return out


def _kept(row: dict) -> dict:
    """``row``, just simulated, stored at once in ``results/memory_recipes.json`` beside the others."""
    data = json.loads(STORED.read_text()) if STORED.exists() else {"schema_version": 1, "rows": []}
    data["rows"] = [r for r in data["rows"] if r["recipe"] != row["recipe"]] + [row]
    STORED.write_text(json.dumps(data, indent=1) + "\n")
    return row


__all__ = ["rows"]
