"""Wall time of ``tensoropt launch SCRIPT --device cpu --gpus N --dry-run``, the whole command as a
user runs it (Python start, imports, capture or cache, search of every engine's space, plan file).

"cold" is the first launch of a script (it runs once in capture mode); "cached" is a later launch
with unchanged sources (target: <= 3 s). Each is the median of ``--repeats`` fresh commands.

    python benchmarks/launch_dry_run.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_results

REPO = Path(__file__).resolve().parent.parent
CASES = [("examples/train_gpt.py", 2, []), ("examples/train_gpt.py", 8, ["--layers", "24", "--global-batch", "64"]),
         ("examples/train_llama_hf.py", 2, [])]


def dry_run_s(script: str, gpus: int, args: list[str], cache_dir: str, *extra: str) -> tuple[float, str]:
    env = {**os.environ, "TENSOROPT_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "tensoropt", "launch", script, "--device", "cpu", "--gpus",
                              str(gpus), "--dry-run", "--run-dir", run_dir, *extra, "--", *args], capture_output=True,
                             text=True, check=True, cwd=REPO, env=env).stdout
        return time.perf_counter() - start, out.splitlines()[0].removeprefix("chosen: ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for script, gpus, script_args in CASES:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = [dry_run_s(script, gpus, script_args, cache_dir, "--no-cache")[0] for _ in range(args.repeats)]
            dry_run_s(script, gpus, script_args, cache_dir)                       # fill the cache
            cached = [dry_run_s(script, gpus, script_args, cache_dir) for _ in range(args.repeats)]
        rows.append({"script": " ".join([script, *script_args]), "gpus": gpus, "chosen": cached[0][1],
                     "cold_s": statistics.median(cold), "cached_s": statistics.median(t for t, _ in cached),
                     "cached_max_s": max(t for t, _ in cached)})
        print(rows[-1], flush=True)
    table = "| script | --gpus | chosen | cold (s) | cached median (s) | cached max (s) |\n|---|---|---|---|---|---|\n"
    table += "".join(f"| `{r['script']}` | {r['gpus']} | {r['chosen']} | {r['cold_s']:.2f} | {r['cached_s']:.2f} | "
                     f"{r['cached_max_s']:.2f} |\n" for r in rows)
    write_results("launch_dry_run", rows, table, "\nTarget: a dry run with a cached capture in <= 3 s. Median of "
                  f"{args.repeats} fresh `tensoropt launch --dry-run` commands each, wall time as the user sees it.\n")


if __name__ == "__main__":
    main()
