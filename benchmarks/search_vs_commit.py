"""This checkout's planner against an earlier commit's, timed by turns on the same machine in the same minutes.

Issue 34 asks that llama2-70b on 512 GPUs and llama3-8b on 64 plan no slower than at ef93596. This VM's speed
drifts by 30% and more within minutes, so figures from another day (or another CPU) cannot say that; this script
extracts the earlier commit's ``tensoropt/`` and ``profiles/`` into a temporary folder (``git archive``), starts one
process per side and row, and asks them by turns for a batch of runs each, ``--rounds`` times: each pair of batches
meets the same machine (``_by_turns.py``).

What each side times is what its own ``benchmarks/search_speed.py`` timed: at ef93596, ``search()`` of its one
space on a cost model built once (its space: one precision's states, no engines); here ``tensoropt.plan`` over the
whole space the engines run (both engines, every priced graph), the figure ``tensoropt frontier`` reports. With
``--api plan`` the earlier side times ``tensoropt.plan`` too (commits since issue 34).
Per row: each side's median CPU time per run, and the median over rounds of (this checkout / earlier).

    python benchmarks/search_vs_commit.py [--commit ef93596] [--rounds 8] [--api search|plan]
    # writes results/search_vs_commit.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _by_turns import by_turns, median_ratio, planner_row, source_at
from _common import REPO, write_results

ROWS = [("llama2-70b/512 a100", "llama2-70b", 512, 1024, "a100-80gb"),
        ("llama3-8b/64 h100", "llama3-8b", 64, 512, "h100-80gb"),
        ("gpt3-175b/1024 a100", "gpt3-175b", 1024, 1536, "a100-80gb")]
RUNS = 5                   # runs per batch


def compare(earlier: Path, rounds: int, api: str) -> list[dict]:
    """Per row, each side's median CPU time per run and the median over rounds of (now / earlier)."""
    out = []
    for label, name, devices, batch, profile in ROWS:
        rows = {"earlier": planner_row(name, devices, batch, profile, api=api),
                "now": planner_row(name, devices, batch, profile)}
        seconds = by_turns({"earlier": earlier, "now": REPO}, rows, rounds, RUNS)
        out.append({"label": label, "earlier_median_s": statistics.median(seconds["earlier"]),
                    "now_median_s": statistics.median(seconds["now"]),
                    "ratio": median_ratio(seconds, "now", "earlier"), "rounds": rounds})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="ef93596")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--api", choices=("search", "plan"), default="search",
                        help="what the earlier side times: search() of its one space (ef93596's benchmark, the "
                             "default) or tensoropt.plan over its whole space (commits since issue 34)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(source_at(REPO, args.commit, Path(tmp)), args.rounds, args.api)
    earlier = "search() of its space" if args.api == "search" else "tensoropt.plan, whole space"
    lines = [f"| row | {args.commit}: {earlier} (ms) | now: tensoropt.plan, whole space (ms) "
             "| now / then (median of rounds) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['label']} | {r['earlier_median_s'] * 1e3:.1f} | {r['now_median_s'] * 1e3:.1f} | "
              f"{r['ratio']:.2f} |" for r in rows]
    then = ("`search()` of its one space on a cost model built once, as its `benchmarks/search_speed.py` did"
            if args.api == "search" else "`tensoropt.plan` over its whole space")
    notes = (f"\nCPU time per run, medians over {args.rounds} rounds of {RUNS} runs, the two sides by turns on the "
             f"same machine. {args.commit} timed {then}; now `tensoropt.plan` over the whole space the engines run, "
             "with the cost model kept between plans of the same graph and devices (`planning.model_cost`).\n")
    write_results("search_vs_commit", rows, "\n".join(lines) + "\n", notes, extra={"commit": args.commit})
    return 0


if __name__ == "__main__":
    sys.exit(main())
