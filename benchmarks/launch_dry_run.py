"""Wall time and peak memory of ``tensoropt launch SCRIPT ... --dry-run``, the whole command as a user runs
it (Python start, imports, capture or cache, search of every engine's space, plan file).

"cold" is the first launch of a script (it runs once in capture mode, every tensor on the meta device);
"cached" is a later launch with unchanged sources (target: <= 3 s). Each is the median of ``--repeats``
fresh commands. Peak RSS is the largest resident set of the launcher and its capture run (``wait4``) over
the cold launches: LLaMA-2 70B must be captured in seconds and well under 2 GB, built on meta or not.

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
CPU2, CPU8, GPUS64 = ["--device", "cpu", "--gpus", "2"], ["--device", "cpu", "--gpus", "8"], \
    ["--device", "cuda", "--gpus", "8", "--nnodes", "8"]
CASES = [("examples/train_gpt.py", CPU2, []),
         ("examples/train_gpt.py", CPU8, ["--layers", "24", "--global-batch", "64"]),
         ("examples/train_llama_hf.py", CPU2, []), ("examples/train_llama_large.py", GPUS64, []),
         ("examples/train_llama_large.py", GPUS64, ["--no-meta"])]


def dry_run(script: str, launch_args: list[str], args: list[str], cache_dir: str,
            *extra: str) -> tuple[float, str, int]:
    """(wall seconds, chosen plan, peak RSS bytes of the launcher and its children) of one dry run."""
    env = {**os.environ, "TENSOROPT_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tensoropt", "launch", script, *launch_args, "--dry-run",
                                 "--run-dir", run_dir, *extra, "--", *args], stdout=subprocess.PIPE, text=True,
                                cwd=REPO, env=env)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        if status:
            raise SystemExit(f"launch_dry_run: {script} {' '.join(launch_args)} failed")
        chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
        return seconds, chosen.removeprefix("chosen: "), usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for script, launch_args, script_args in CASES:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = [dry_run(script, launch_args, script_args, cache_dir, "--no-cache") for _ in range(args.repeats)]
            dry_run(script, launch_args, script_args, cache_dir)                       # fill the cache
            cached = [dry_run(script, launch_args, script_args, cache_dir) for _ in range(args.repeats)]
        rows.append({"script": " ".join([script, *script_args]), "launch": " ".join(launch_args),
                     "chosen": cached[0][1], "cold_s": statistics.median(t for t, _, _ in cold),
                     "cold_peak_rss_bytes": max(rss for _, _, rss in cold),
                     "cached_s": statistics.median(t for t, _, _ in cached),
                     "cached_max_s": max(t for t, _, _ in cached)})
        print(rows[-1], flush=True)
    table = ("| script | launch | chosen | cold (s) | cold peak RSS (MiB) | cached median (s) | cached max (s) |\n"
             "|---|---|---|---:|---:|---:|---:|\n")
    table += "".join(f"| `{r['script']}` | `{r['launch']}` | {r['chosen']} | {r['cold_s']:.2f} | "
                     f"{r['cold_peak_rss_bytes'] / 2**20:.0f} | {r['cached_s']:.2f} | {r['cached_max_s']:.2f} |\n"
                     for r in rows)
    write_results("launch_dry_run", rows, table, "\nTarget: a dry run with a cached capture in <= 3 s. Median of "
                  f"{args.repeats} fresh `tensoropt launch --dry-run` commands each, wall time as the user sees it. "
                  "`--device cuda` on this GPU-less machine plans for the h100-80gb datasheet profile.\n")


if __name__ == "__main__":
    main()
