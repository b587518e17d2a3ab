"""This checkout's planner against an earlier commit's, timed by turns on the same machine in the same minutes.

Issue 34 asks that llama2-70b on 512 GPUs and llama3-8b on 64 plan no slower than at ef93596. This VM's speed
drifts by 30% and more within minutes, so figures from another day (or another CPU) cannot say that; this script
checks the earlier commit out (``git worktree``, into a temporary folder), starts one process per commit and row,
and asks them by turns for a batch of runs each, ``--rounds`` times: each pair of batches meets the same machine.

What each side times is what its own ``benchmarks/search_speed.py`` timed: at ef93596, ``search()`` of its one
space on a cost model built once (its space: one precision's states, no engines); here ``tensoropt.plan`` over the
whole space the engines run (both engines, every priced graph), the figure ``tensoropt frontier`` reports.
Per row: each side's median CPU time per run, and the median over rounds of (this checkout / earlier).

    python benchmarks/search_vs_commit.py [--commit ef93596] [--rounds 8]    # writes results/search_vs_commit.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, write_results

ROWS = [("llama2-70b/512 a100", "llama2-70b", 512, 1024, "a100-80gb"),
        ("llama3-8b/64 h100", "llama3-8b", 64, 512, "h100-80gb"),
        ("gpt3-175b/1024 a100", "gpt3-175b", 1024, 1536, "a100-80gb")]
RUNS = 5                   # runs per batch

# a worker: builds its side's planner for one row, then times RUNS runs each time it reads a line
WORKER = r'''
import sys, time
import tensoropt
from tensoropt.cost.profile import Cluster, load_profile
side, name, devices, batch, profile, runs = sys.argv[1:7]
devices, batch, runs = int(devices), int(batch), int(runs)
if side == "earlier":
    from tensoropt.cost.model import ModelCost
    from tensoropt.search.ft import SearchSpace, search
    graph = tensoropt.capture(name).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(devices, 8, load_profile(profile)))
    space = SearchSpace(global_batch=batch)
    run = lambda: search(model, devices, space)
else:
    captured = tensoropt.capture(name, precision="bf16-mixed")
    cluster = Cluster(devices, 8, load_profile(profile))
    run = lambda: tensoropt.plan(captured, cluster, global_batch=batch)
run(); run()
for _ in sys.stdin:
    start = time.process_time()
    for _ in range(runs):
        run()
    print((time.process_time() - start) / runs, flush=True)
'''


def _worker(source: Path, side: str, row: tuple) -> subprocess.Popen:
    _, name, devices, batch, profile = row
    return subprocess.Popen([sys.executable, "-c", WORKER, side, name, str(devices), str(batch), profile, str(RUNS)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=source,
                            env={"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})


def compare(earlier: Path, rounds: int) -> list[dict]:
    out = []
    for row in ROWS:
        sides = {"earlier": _worker(earlier, "earlier", row), "now": _worker(REPO, "now", row)}
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(rounds):
            for side, proc in sides.items():
                proc.stdin.write("go\n")
                proc.stdin.flush()
                seconds[side].append(float(proc.stdout.readline()))
        for proc in sides.values():
            proc.stdin.close()
            proc.wait()
        out.append({"label": row[0], "earlier_median_s": statistics.median(seconds["earlier"]),
                    "now_median_s": statistics.median(seconds["now"]),
                    "ratio": statistics.median(n / e for n, e in zip(seconds["now"], seconds["earlier"])),
                    "rounds": rounds})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="ef93596")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        earlier = Path(tmp) / "earlier"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(earlier), args.commit], cwd=REPO, check=True)
        try:
            rows = compare(earlier, args.rounds)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(earlier)], cwd=REPO, check=False)
    lines = [f"| row | {args.commit}: search() of its space (ms) | now: tensoropt.plan, whole space (ms) "
             "| now / then (median of rounds) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['label']} | {r['earlier_median_s'] * 1e3:.1f} | {r['now_median_s'] * 1e3:.1f} | "
              f"{r['ratio']:.2f} |" for r in rows]
    notes = (f"\nCPU time per run, medians over {args.rounds} rounds of {RUNS} runs, the two sides by turns on the "
             f"same machine. {args.commit} timed `search()` of its one space on a cost model built once, as its "
             "`benchmarks/search_speed.py` did; now `tensoropt.plan` over the whole space the engines run, with the "
             "cost model kept between plans of the same graph and devices (`planning.model_cost`).\n")
    write_results("search_vs_commit", rows, "\n".join(lines) + "\n", notes, extra={"commit": args.commit})
    return 0


if __name__ == "__main__":
    sys.exit(main())
