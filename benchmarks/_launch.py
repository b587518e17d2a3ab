"""Helpers of the benchmarks that train through ``tensoropt launch``: run a command (a failure is one line),
and launch a script under a plan and read back what it reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run(argv: list[str], cwd: str, env: dict, timeout_s: float = 900) -> None:
    """Run ``argv``; a failure ends the benchmark with its last line of error output."""
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{Path(sys.argv[0]).stem}: {' '.join(argv[:6])} ... failed: {tail}")


def launched(script: str, launch_args: list[str], script_args: list[str], run_dir: Path, env: dict) -> dict:
    """``tensoropt launch SCRIPT LAUNCH_ARGS -- SCRIPT_ARGS --out``: what rank 0 wrote (losses, step times,
    ``Run.device_report()``) with the launcher's prediction under ``predicted``."""
    out = run_dir / "out.json"
    run([sys.executable, "-m", "tensoropt", "launch", script, *launch_args, "--run-dir", str(run_dir), "--",
         *script_args, "--out", str(out)], str(run_dir.parent), env)
    data = json.loads(out.read_text())
    data["predicted"] = json.loads((run_dir / "plan.json").read_text())["predicted"]
    return data
