"""Helpers shared by the benchmark scripts: machine description and result files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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
