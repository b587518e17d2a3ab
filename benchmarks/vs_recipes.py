"""The launcher's choice against published hand-tuned layouts (issue 33), priced the same way.

For each workload of ``_recipes.py`` the launcher plans ``benchmarks/preset_train.py`` building the model on the meta
device exactly as a user's launch does (``tensoropt launch ... --dry-run``, objective fastest, the h100-80gb profile,
its default precision); the recipe's own plan is then priced by the launcher's own pricing (``launcher.launch.price``:
the torch engine's states, kernels and collectives in that precision) on the very graph the launcher captured, and
said to fit when its predicted peak is within the device's memory. Target: launcher / recipe <= 1.00 (the launcher's
choice no slower than the recipe priced the same way), and every recipe fits as the runtime holds it.

    python benchmarks/vs_recipes.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._common import write_results  # noqa: E402
from benchmarks._recipes import RECIPES, SCRIPT, Recipe  # noqa: E402

TARGET = 1.00


def launcher_plan(recipe: Recipe, cache_dir: str) -> dict:
    """plan.json of ``tensoropt launch SCRIPT --dry-run`` for the recipe's model, devices and global batch."""
    env = {**os.environ, "TENSOROPT_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as run_dir:
        argv = [sys.executable, "-m", "tensoropt", "launch", SCRIPT, *recipe.launch_args(), "--dry-run", "--run-dir",
                run_dir, "--objective", "fastest", "--", *recipe.script_args()]
        result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        if result.returncode:
            raise SystemExit(f"vs_recipes: {recipe.name}: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads((Path(run_dir) / "plan.json").read_text())


def recipe_priced(recipe: Recipe, precision: str, cache_dir: str):
    """The recipe's plan priced as the launcher prices a plan it runs (same graph, devices and precision)."""
    os.environ["TENSOROPT_CACHE_DIR"] = cache_dir
    from launcher.capture import capture_script
    from launcher.devices import detect
    from launcher.launch import price
    graph = capture_script(SCRIPT, recipe.script_args(), precision=precision)
    devices = detect("cuda", min(recipe.per_node, recipe.gpus), None, "h100-80gb", dry_run=True)
    devices = dataclasses.replace(devices, count=recipe.gpus)
    point = price(graph, devices, recipe.per_node, recipe.plan(precision), "torch", precision)
    return point, devices.memory_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="these recipes only (results not written)")
    args = parser.parse_args()
    rows = []
    for recipe in RECIPES:
        if args.only and recipe.name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as cache_dir:
            chosen = launcher_plan(recipe, cache_dir)
            point, memory_bytes = recipe_priced(recipe, chosen["precision"], cache_dir)
        predicted = chosen["predicted"]
        row = {"recipe": recipe.name, "model": recipe.model, "gpus": recipe.gpus, "global_batch": recipe.global_batch,
               "precision": chosen["precision"], "launcher_plan": chosen["summary"], "engine": chosen["engine"],
               "launcher_time_s": predicted["iteration_time_s"],
               "launcher_memory_gib": predicted["peak_memory_bytes"] / 2**30,
               "recipe_plan": point.plan.summary(), "recipe_time_s": point.iteration_time_s,
               "recipe_memory_gib": point.peak_memory_bytes / 2**30,
               "recipe_fits": point.peak_memory_bytes <= memory_bytes,
               "time_ratio": predicted["iteration_time_s"] / point.iteration_time_s}
        rows.append(row)
        print(f"{recipe.name}: launcher {row['launcher_plan']} {row['launcher_time_s']:.3f} s, recipe "
              f"{row['recipe_plan']} {row['recipe_time_s']:.3f} s ({row['recipe_memory_gib']:.1f} GiB, "
              f"{'fits' if row['recipe_fits'] else 'DOES NOT FIT'}): {row['time_ratio']:.3f}", flush=True)
    table = ["| recipe | GPUs | global batch | launcher's plan (engine) | time (s) | memory (GiB) | recipe | "
             "time (s) | memory (GiB) | fits | launcher / recipe |",
             "|---|---:|---:|---|---:|---:|---|---:|---:|---|---:|"]
    table += [f"| {r['recipe']} | {r['gpus']} | {r['global_batch']} | `{r['launcher_plan']}` ({r['engine']}) | "
              f"{r['launcher_time_s']:.3f} | {r['launcher_memory_gib']:.1f} | `{r['recipe_plan']}` | "
              f"{r['recipe_time_s']:.3f} | {r['recipe_memory_gib']:.1f} | {'yes' if r['recipe_fits'] else 'NO'} | "
              f"{r['time_ratio']:.3f} |" for r in rows]
    met = all(r["recipe_fits"] and r["time_ratio"] <= TARGET + 1e-9 for r in rows)
    notes = (f"\nProfile h100-80gb (80 GiB per device, datasheet rates), objective fastest, the launcher's default "
             f"precision; both sides priced by `launcher.launch.price` on the graph the launcher captured (torch "
             f"engine). Target: launcher / recipe <= {TARGET:.2f} and every recipe fits: "
             f"{'met' if met else 'NOT met'}. Recipes and their sources: `benchmarks/_recipes.py`.\n")
    if not args.only:
        write_results("vs_recipes", rows, "\n".join(table) + "\n", notes)
    print("\n".join(table))


if __name__ == "__main__":
    main()
