"""Capture + fold time, first time (empty cache) and from the cache, each in a fresh process.

Times are measured inside the process around ``tensoropt.capture`` + ``tensoropt.fold`` (the
Python and torch import, ~1-2 s, is reported apart). Each configuration runs ``--repeats`` times;
the table gives the median and the max.

    python benchmarks/capture_speed.py [--repeats 3] [--models gpt3-175b,llama2-70b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import write_results

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ["gpt3-175b", "llama2-70b", "megatron-1t", "gpt-moe-1.3b", "bert-large", "wide-resnet50-2",
                  "examples/llama2-7b-hf-config.json", "examples/custom_model.py:build"]

PROBE = """
import json, sys, time
t0 = time.perf_counter()
import tensoropt
t1 = time.perf_counter()
captured = tensoropt.capture(sys.argv[1])
folded = tensoropt.fold(captured.graph)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "capture_fold_s": t2 - t1, "cached": captured.cached,
                  "ops": len(captured.graph.ops), "ops_after_folding": folded.ops_after_folding,
                  "blocks": [[b.name, len(b.ops), b.repeats] for b in folded.blocks]}))
"""


def run_once(model: str, cache_dir: str) -> dict:
    env = {"TENSOROPT_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE, model], capture_output=True, text=True, check=True,
                         cwd=REPO, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        first, cached = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache_dir:
                cold = run_once(model, cache_dir)
                warm = run_once(model, cache_dir)
            assert not cold["cached"] and warm["cached"]
            first.append(cold["capture_fold_s"])
            cached.append(warm["capture_fold_s"])
        rows.append({"model": model, "ops": cold["ops"], "ops_after_folding": cold["ops_after_folding"],
                     "blocks": cold["blocks"], "first_median_s": statistics.median(first), "first_max_s": max(first),
                     "cached_median_s": statistics.median(cached), "cached_max_s": max(cached),
                     "import_s": cold["import_s"], "repeats": args.repeats})
        print(rows[-1], flush=True)
    lines = ["| model | ops | ops after folding | unique blocks (ops x repeats) | first capture+fold, median / max (s) "
             "| cached capture+fold, median / max (s) |", "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        blocks = ", ".join(f"{n}: {o}x{k}" for n, o, k in r["blocks"]) or "none"
        lines.append(f"| {r['model']} | {r['ops']} | {r['ops_after_folding']} | {blocks} | "
                     f"{r['first_median_s']:.2f} / {r['first_max_s']:.2f} | "
                     f"{r['cached_median_s']:.3f} / {r['cached_max_s']:.3f} |")
    imports = statistics.median(r["import_s"] for r in rows)
    notes = (f"\nEach run is a fresh process with a fresh cache directory; {args.repeats} runs per model. "
             f"Importing tensoropt (and torch) takes a further ~{imports:.1f} s per process and is not included. "
             "Targets (capture issue): gpt3-175b <= 15 s the first time, <= 1 s from the cache.\n")
    write_results("capture_speed", rows, "\n".join(lines) + "\n", notes)


if __name__ == "__main__":
    main()
