"""Two planners' code timed by turns on the same machine in the same minutes.

This VM's speed drifts by 30% and more within minutes, and a ratio to a fixed workload moves from one CPU to
another (on one 2-core machine the search ran 2x its usual CPU time and the numpy-and-dict reference only 1.3x).
What a pair of processes timed by turns says does not depend on either: one process per source tree, each
planning the same row, asked in turn for a batch of runs, ``rounds`` times; each pair of batches meets the same
machine. Short turns average the machine's sub-second swings best: this checkout against itself on a 2-core VM,
the median over rounds of the pair's ratio ranged 0.92-1.08 in five tries of 8 rounds of 5 runs, 0.985-1.011 in
four of 40 rounds of 1 run (and 0.986-1.013 with a numpy matmul loop busy on the other core).
Used by ``search_speed.py --check`` (this checkout against the commit that set a row's guard) and by
``search_vs_commit.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

# One worker: imports tensoropt from its source tree (PYTHONPATH), prints where from, builds the row's planner,
# then times ``runs`` runs (CPU seconds per run) each time it reads a line. ``api``: "plan" is tensoropt.plan over
# the whole space (what ``tensoropt frontier`` times); "search" is ef93596's search() of its one space.
WORKER = r'''
import json, sys, time
import tensoropt
from tensoropt.cost.profile import Cluster, load_profile
row, runs = json.loads(sys.argv[1]), int(sys.argv[2])
print(tensoropt.__file__, flush=True)
cluster = Cluster(row["devices"], 8, load_profile(row["profile"]))
if row["api"] == "search":
    from tensoropt.cost.model import ModelCost
    from tensoropt.search.ft import SearchSpace, search
    graph = tensoropt.capture(row["model"]).graph
    model = ModelCost(graph, tensoropt.fold(graph), cluster)
    space = SearchSpace(global_batch=row["batch"])
    run = lambda: search(model, row["devices"], space)
else:
    from tensoropt.search.limits import Limits
    captured = tensoropt.capture(row["model"], precision="bf16-mixed")
    limits = Limits(pipeline_stages=tuple(row["stages"])) if row["stages"] else Limits()
    run = lambda: tensoropt.plan(captured, cluster, global_batch=row["batch"], limits=limits,
                                 fold_blocks=row["folded"])
run(); run()
print("ready", flush=True)
for _ in sys.stdin:
    start = time.process_time()
    for _ in range(runs):
        run()
    print((time.process_time() - start) / runs, flush=True)
'''


def planner_row(model: str, devices: int, batch: int, profile: str, folded: bool = True,
                stages: tuple[int, ...] | None = None, api: str = "plan") -> dict:
    """What a worker plans: ``model`` a preset name or a path to a model JSON."""
    return {"model": model, "devices": devices, "batch": batch, "profile": profile, "folded": folded,
            "stages": list(stages) if stages else None, "api": api}


def _start(source: Path, row: dict, runs: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(row), str(runs)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=source,
                            env={"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})


def _line(proc: subprocess.Popen, side: str) -> str:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the {side} worker exited (code {proc.wait()}) before answering")
    return line.strip()


def by_turns(sources: dict[str, Path], rows: dict[str, dict], rounds: int = 40,
             runs: int = 1) -> dict[str, list[float]]:
    """CPU seconds per run, one list of ``rounds`` batch means per side: ``sources`` maps a side's name to the
    folder holding its ``tensoropt/`` (and ``profiles/``), ``rows`` what each side plans."""
    procs = {side: _start(source, rows[side], runs) for side, source in sources.items()}
    try:
        for side, proc in procs.items():
            imported = Path(_line(proc, side)).resolve()
            if not imported.is_relative_to(sources[side].resolve()):
                raise RuntimeError(f"the {side} worker imported tensoropt from {imported}, not {sources[side]}")
            if _line(proc, side) != "ready":
                raise RuntimeError(f"the {side} worker did not get ready")
        seconds: dict[str, list[float]] = {side: [] for side in procs}
        for _ in range(rounds):
            for side, proc in procs.items():
                proc.stdin.write("go\n")
                proc.stdin.flush()
                seconds[side].append(float(_line(proc, side)))
        return seconds
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()


def median_ratio(seconds: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over rounds of one side's time over the other's in the same round."""
    return statistics.median(n / d for n, d in zip(seconds[numerator], seconds[denominator]))


def source_at(repo: Path, commit: str, dest: Path) -> Path:
    """``commit``'s ``tensoropt/`` and ``profiles/`` extracted into ``dest`` (no worktree left behind)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit, "tensoropt", "profiles"], cwd=repo, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest
