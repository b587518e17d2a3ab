"""What torchrun itself costs a launch: ``python -m torch.distributed.run`` against ``python -m launcher.torchrun``
(the launcher's, with the dynamic rendezvous's event names read from frames instead of ``inspect.stack()``), each
starting 2 workers of a script that imports nothing (``--standalone``, the launcher's single-node rendezvous), so
that what is timed is the agent: its start, rendezvous, the workers' start and its exit.

Timed by turns (one of each, ``--repeats`` times) so that both meet the same load; reported per variant: the median
wall seconds of the whole command and the median CPU seconds of torchrun and its workers (``wait4``: cold
processes, each importing torch in the agent).

    python benchmarks/torchrun_start.py [--repeats 7]
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
VARIANTS = {"torch.distributed.run": "torch's torchrun", "launcher.torchrun": "the launcher's torchrun"}


def _once(module: str, script: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of torchrun and everything it waited for) of one 2-worker start."""
    argv = [sys.executable, "-m", module, "--nproc-per-node", "2", "--standalone", str(script)]
    env = {k: v for k, v in os.environ.items() if k != "TENSOROPT_TEST_WARM_SOCKET"} | {"OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{module} exited with status {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "worker.py"
        script.write_text("import os\nprint(os.environ['RANK'])\n")
        runs: dict[str, list[tuple[float, float]]] = {module: [] for module in VARIANTS}
        for _ in range(args.repeats):
            for module in VARIANTS:
                runs[module].append(_once(module, script))
    rows = [{"torchrun": module, "what": what, "runs": len(runs[module]),
             "median_wall_s": round(statistics.median(w for w, _ in runs[module]), 3),
             "median_cpu_s": round(statistics.median(c for _, c in runs[module]), 3)}
            for module, what in VARIANTS.items()]
    table = "| torchrun | runs | median wall s | median CPU s |\n|---|---:|---:|---:|\n" + "".join(
        f"| `python -m {r['torchrun']}` ({r['what']}) | {r['runs']} | {r['median_wall_s']} | {r['median_cpu_s']} |\n"
        for r in rows)
    notes = ("2 workers of a script that imports nothing, `--standalone`, run by turns; CPU: torchrun and the "
             "processes it waited for (each cold, torch imported in the agent).\n")
    write_results("torchrun_start", rows, table, notes)
    print(table)


if __name__ == "__main__":
    main()
