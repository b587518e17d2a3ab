"""Frontier quality: FT against a Megatron-style expert grid and NSGA-II (given 10x FT's time),
all over the same global choices and layer strategies and the same cost model (profiles/a100-80gb.json); FT
groups a stage's copies into at most 16 equal groups, NSGA-II and the grid do not.

Reports hypervolume (fronts normalised together, reference point 1.1), the fastest plan within
several memory budgets, and the least memory each method reaches; plots the three fronts.

    python benchmarks/frontier_quality.py
"""

from __future__ import annotations

import numpy as np
from _common import RESULTS, write_results

import tensoropt
from tensoropt.cost.model import ModelCost
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.search.baselines import expert_grid, hypervolume, nsga2
from tensoropt.search.ft import SearchSpace, search

CASES = [("gpt3-175b", 1024, 1536), ("llama2-70b", 512, 1024)]
BUDGETS_GIB = (20, 40, 60, 80)


def front(result) -> np.ndarray:
    return np.array([[p.iteration_time_s, p.peak_memory_bytes] for p in result.points])


def fastest_within(result, budget_bytes: float):
    fits = [p for p in result.points if p.peak_memory_bytes <= budget_bytes]
    return min(fits, key=lambda p: p.iteration_time_s) if fits else None


def plot(name: str, results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, r in results.items():
        f = front(r)
        ax.plot(f[:, 1] / 2**30, f[:, 0], "o-" if label == "FT" else "s--", ms=3, label=f"{label} ({len(f)} points)")
    ax.set_xscale("log")
    ax.set_xlabel("peak memory per device (GiB, log)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"{name}: frontier tracking vs baselines (same cost model)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"frontier_{name}.png")
    plt.close(fig)


def main() -> None:
    rows = []
    for name, devices, batch in CASES:
        graph = tensoropt.capture(name).graph
        model = ModelCost(graph, tensoropt.fold(graph), Cluster(devices, 8, load_profile("a100-80gb")))
        ft = search(model, devices, SearchSpace(global_batch=batch))
        results = {"FT": ft, "expert grid": expert_grid(model, devices, batch),
                   "NSGA-II (10x FT time)": nsga2(model, devices, batch, seconds=10 * ft.seconds)}
        hv = hypervolume({k: front(r) for k, r in results.items()})
        plot(name, results)
        for label, r in results.items():
            row = {"model": name, "devices": devices, "global_batch": batch, "method": label,
                   "seconds": r.seconds, "points": len(r.points), "evaluated": r.candidates,
                   "hypervolume": hv[label], "least_memory_gib": front(r)[:, 1].min() / 2**30}
            for b in BUDGETS_GIB:
                best = fastest_within(r, b * 2**30)
                row[f"fastest_within_{b}GiB_s"] = best.iteration_time_s if best else None
                row[f"plan_within_{b}GiB"] = best.plan.summary() if best else None
            rows.append(row)
            print({k: v for k, v in row.items() if not k.startswith("plan")}, flush=True)
    header = "| model | method | search s | points | hypervolume | least GiB | " + \
        " | ".join(f"fastest <= {b} GiB (s)" for b in BUDGETS_GIB) + " |"
    lines = [header, "|" + "---|" * (6 + len(BUDGETS_GIB))]
    for r in rows:
        cells = [f"{r[f'fastest_within_{b}GiB_s']:.2f}" if r[f"fastest_within_{b}GiB_s"] else "none fits"
                 for b in BUDGETS_GIB]
        lines.append(f"| {r['model']} ({r['devices']} GPUs) | {r['method']} | {r['seconds']:.2f} | {r['points']} | "
                     f"{r['hypervolume']:.4f} | {r['least_memory_gib']:.1f} | " + " | ".join(cells) + " |")
    plans = ["", "Fastest plans within 40 GiB:", ""]
    plans += [f"- {r['model']}, {r['method']}: {r['plan_within_40GiB'] or 'none fits'}" for r in rows]
    notes = "\nPlots: " + ", ".join(f"`frontier_{n}.png`" for n, _, _ in CASES) + ".\n" + "\n".join(plans) + "\n"
    write_results("frontier_quality", rows, "\n".join(lines) + "\n", notes)


if __name__ == "__main__":
    main()
