"""Where the test suite's CPU time goes, by process: what a 15-minute suite (issue 34) has to remove.

Runs the README's test command (``pytest -n 2``) with a ``sitecustomize`` hook on ``PYTHONPATH`` that every Python
process the suite starts imports: at exit each one appends its own CPU time (user + system, children not included),
its command line, its parent and whether it imported torch, ``torch._dynamo`` and DeepSpeed to a log. The
processes are then told apart by their parent: workers (under torchrun), torchrun itself, the launcher, what the
launcher runs besides torchrun (captures, memory simulations), and the rest (scripts run alone as references,
``python -c`` helpers, other CLI commands). A process killed by a signal writes nothing; the pytest processes'
own time (the in-process tests) is the suite's CPU time less the logged total.

Also measured here, per process (``--floor``): ``import torch`` and then ``import torch._dynamo``, in fresh
processes. Every training process pays both: ``torch.optim``'s ``step`` and ``zero_grad`` are wrapped in
``torch._disable_dynamo``, which imports ``torch._dynamo`` on the first call, and that import brings
``torch.distributed.tensor`` and FSDP with it.

The suite runs with warm starts off (``TENSOROPT_TEST_WARM=0``, tests/conftest.py): each process as a user's
starts, importing what it needs (a warm-started process is forked by a server and would not be logged alike).

    python benchmarks/suite_processes.py                 # the whole suite (~45 min on 2 cores), then the tables
    python benchmarks/suite_processes.py --log LOG        # the tables of a log written before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, write_results

LOG_ENV = "TENSOROPT_SUITE_PROCESS_LOG"
HOOK = f'''import atexit, json, os, sys, time
_start = time.time()
def _note():
    try:
        t = os.times()
        record = {{"argv": " ".join(sys.argv)[:400], "pid": os.getpid(), "ppid": os.getppid(),
                   "cpu_s": round(t.user + t.system, 3), "wall_s": round(time.time() - _start, 3),
                   "torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                   "deepspeed": "deepspeed" in sys.modules}}
        fd = os.open(os.environ["{LOG_ENV}"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (json.dumps(record) + "\\n").encode())
        os.close(fd)
    except Exception:
        pass
if os.environ.get("{LOG_ENV}"):
    atexit.register(_note)
'''
TORCHRUNS = ("torch/distributed/run.py", "launcher/torchrun.py")     # torch's, and the launcher's (launcher.torchrun)
LAUNCHER = "tensoropt/__main__.py launch"
PYTEST = "pytest/__main__.py"                 # the controlling process (xdist's own exit without the hook)
KINDS = ("worker", "torchrun", "launcher", "launcher's capture or simulation", "script alone / helper", "CLI")


def kind(record: dict, by_pid: dict[int, dict]) -> str:
    """Which of ``KINDS`` a logged process is, from its command line and its parent's."""
    argv, parent = record["argv"], by_pid.get(record["ppid"], {}).get("argv", "")
    if any(t in argv for t in TORCHRUNS):
        return "torchrun"
    if LAUNCHER in argv:
        return "launcher"
    if "tensoropt/__main__.py" in argv:
        return "CLI"
    if any(t in parent for t in TORCHRUNS):
        return "worker"
    if LAUNCHER in parent:
        return "launcher's capture or simulation"
    return "script alone / helper"


def tables(records: list[dict], suite_cpu_s: float | None) -> tuple[list[dict], str]:
    by_pid = {r["pid"]: r for r in records}
    by_kind: dict[str, list[dict]] = {name: [] for name in KINDS}
    for r in records:
        if not r["argv"].split(" ")[0].endswith(PYTEST):
            by_kind[kind(r, by_pid)].append(r)
    rows = []
    for name, mine in by_kind.items():
        cpu = sum(r["cpu_s"] for r in mine)
        rows.append({"kind": name, "processes": len(mine), "cpu_s": round(cpu, 1),
                     "cpu_s_each": round(cpu / len(mine), 2) if mine else 0.0,
                     "with_torch": sum(r["torch"] for r in mine), "with_dynamo": sum(r["dynamo"] for r in mine),
                     "with_deepspeed": sum(r["deepspeed"] for r in mine)})
    logged = sum(row["cpu_s"] for row in rows)
    lines = ["| process | count | CPU s | CPU s each | imported torch | torch._dynamo | DeepSpeed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['processes']} | {r['cpu_s']:.0f} | {r['cpu_s_each']:.2f} | {r['with_torch']} | "
              f"{r['with_dynamo']} | {r['with_deepspeed']} |" for r in rows]
    lines.append(f"| all logged | {sum(r['processes'] for r in rows)} | {logged:.0f} | | "
                 f"{sum(r['with_torch'] for r in rows)} | | |")
    if suite_cpu_s is not None:
        lines.append(f"\nThe suite's CPU time (pytest and every process under it): {suite_cpu_s:.0f} s; the pytest "
                     f"processes themselves (in-process tests) and unlogged processes: {suite_cpu_s - logged:.0f} s.")
    return rows, "\n".join(lines) + "\n"


def import_floor(runs: int = 3) -> dict:
    """CPU seconds of ``import torch`` and of ``import torch._dynamo`` after it, each the least of ``runs`` fresh
    processes."""
    code = ("import time; t0 = time.process_time(); import torch; t1 = time.process_time(); import torch._dynamo; "
            "import sys; print(t1 - t0, time.process_time() - t1, 'torch.distributed.tensor' in sys.modules)")
    best = None
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        got = (float(out[0]), float(out[1]), out[2] == "True")
        best = got if best is None else (min(best[0], got[0]), min(best[1], got[1]), got[2])
    return {"import_torch_cpu_s": round(best[0], 2), "import_dynamo_cpu_s": round(best[1], 2),
            "dynamo_brings_dtensor": best[2]}


def run_suite(log: Path, pytest_args: list[str]) -> tuple[float, float]:
    """The suite under the hook: (wall seconds, CPU seconds of pytest and everything under it)."""
    with tempfile.TemporaryDirectory() as hook_dir:
        (Path(hook_dir) / "sitecustomize.py").write_text(HOOK)
        env = {**os.environ, LOG_ENV: str(log), "TENSOROPT_TEST_WARM": "0",     # every process started cold
               "PYTHONPATH": os.pathsep.join(p for p in (hook_dir, os.environ.get("PYTHONPATH", "")) if p)}
        start, before = time.time(), os.times()
        status = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                                 *pytest_args], cwd=REPO, env=env).returncode
        after = os.times()
    if status:
        raise SystemExit(f"the suite failed (status {status}): the figures would not be the suite's")
    return time.time() - start, (after.children_user - before.children_user) + (after.children_system -
                                                                                 before.children_system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", help="tabulate this log (written by an earlier run) instead of running the suite")
    parser.add_argument("--suite-cpu-s", type=float, help="with --log: the suite's CPU time, if known")
    parser.add_argument("--suite-wall-s", type=float, help="with --log: the suite's wall time, if known")
    parser.add_argument("--recorded-at", default="", help="with --log: the commit the log was recorded at")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    if args.log:
        log, wall, cpu = Path(args.log), args.suite_wall_s, args.suite_cpu_s
    else:
        log = Path(tempfile.mkdtemp(prefix="suite-processes-")) / "processes.jsonl"
        wall, cpu = run_suite(log, args.pytest_args)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    rows, table = tables(records, cpu)
    floor = import_floor()
    notes = (f"Per fresh process (least of 3): `import torch` {floor['import_torch_cpu_s']} CPU s, then "
             f"`import torch._dynamo` {floor['import_dynamo_cpu_s']} CPU s (brings torch.distributed.tensor: "
             f"{floor['dynamo_brings_dtensor']}). Every training process pays both (torch.optim imports "
             "torch._dynamo at its first step).\n")
    if wall is not None:
        notes = f"Suite wall time {wall:.0f} s (`pytest -n 2`).\n\n" + notes
    if args.recorded_at:
        notes = f"The log was recorded at commit {args.recorded_at} (the tables above are of that run).\n\n" + notes
    print(table + "\n" + notes)
    write_results("suite_processes", rows, table, notes, extra={"import_floor": floor, "suite_wall_s": wall,
                                                                "suite_cpu_s": cpu})


if __name__ == "__main__":
    main()
