"""Helpers shared by the benchmark scripts: machine description, result files, and the simulated memory check."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def machine() -> dict:
    import torch

    from tensoropt.profiler.run import device_name
    cpu = device_name("cpu")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": commit}


def write_results(name: str, rows: list[dict], table_md: str, notes: str = "", extra: dict | None = None) -> None:
    """``results/NAME.json`` (machine, rows, and any ``extra`` top-level keys) and ``results/NAME.md``."""
    RESULTS.mkdir(exist_ok=True)
    info = machine()
    (RESULTS / f"{name}.json").write_text(json.dumps({"schema_version": 1, "machine": info, "rows": rows,
                                                      **(extra or {})}, indent=1) + "\n")
    header = (f"Machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, torch {info['torch']}; "
              f"{info['date']}, commit {info['commit']}.\n\n")
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\n{header}{table_md}\n{notes}")


def check_memory(script: str, launch_args: list[str], script_args: list[str], plan, cache_dir: str,
                 env: dict[str, str] | None = None, timeout_s: float = 900) -> dict:
    """What ``tensoropt launch SCRIPT LAUNCH_ARGS --plan PLAN --precision ITS_PRECISION --dry-run --check-memory``
    wrote (``memory_check.json``: simulated and predicted) for ``plan`` (a ``tensoropt.space.plan.Plan``), run in a
    subprocess from the repository root with the capture cache in ``cache_dir`` and ``env`` added; a failed launch
    exits naming the plan, with its last line."""
    env = {**os.environ, "TENSOROPT_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "given.json"
        plan_file.write_text(json.dumps(plan.to_json()))
        result = subprocess.run([sys.executable, "-m", "tensoropt", "launch", script, *launch_args, "--plan",
                                 str(plan_file), "--precision", plan.precision, "--dry-run", "--check-memory",
                                 "--run-dir", str(Path(tmp) / "run"), "--", *script_args],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        out = Path(tmp) / "run" / "memory_check.json"
        if result.returncode or not out.exists():
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SystemExit(f"check-memory of {plan.summary()} failed: {tail}")
        return json.loads(out.read_text())


def memory_error(row: dict) -> float:
    """predicted / actual - 1 of a memory row's tensor bytes (``memory_accuracy.py``'s target is 0 to +5%)."""
    return row["predicted_tensor_bytes"] / row["actual_bytes"] - 1
