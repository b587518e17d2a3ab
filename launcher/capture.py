"""Learn the model from the training script: run it once in capture mode, with a cache.

Capturing runs the script in a fresh Python (importing torch alone takes ~1 s), which would make
every ``--dry-run`` slow. The capture-mode run therefore lists the user's source files it loaded
(the script and every module imported from outside the Python installation) with their sizes
and modification times; a later launch with the same script, arguments and interpreter reuses
the graph if none of those files changed. Data files the script reads are not tracked: after
changing one, pass ``--no-cache``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tensoropt.errors import TensorOptError, last_line
from tensoropt.graph.cache import GraphCache, fingerprint
from tensoropt.graph.ir import OpGraph
from tensoropt.runtime import CAPTURE_ENV, PLAN_ENV, PRECISION_ENV

from .argv import capture_argv

SOURCES_META = "sources"      # graph metadata: JSON list of [path, size, mtime_ns] the capture loaded


def _stamp(path: str) -> list | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return [path, stat.st_size, stat.st_mtime_ns]


def _unchanged(graph: OpGraph) -> bool:
    sources = json.loads(graph.meta(SOURCES_META) or "null")
    return bool(sources) and all(_stamp(path) == [path, size, mtime] for path, size, mtime in sources)


def cache_key(script: str, args: list[str], precision: str | None = None) -> str:
    from tensoropt.api import CAPTURE_VERSION
    return "launch-" + fingerprint({"script": str(Path(script).resolve()), "args": args, "python": sys.executable,
                                    "cwd": os.getcwd(), "capture_version": CAPTURE_VERSION} |
                                   ({"precision": precision} if precision else {}))


def capture_script(script: str, args: list[str], use_cache: bool = True, timeout_s: float = 600,
                   precision: str | None = None) -> OpGraph:
    """The script's model graph: from the cache when its sources are unchanged, else by running it
    once in capture mode (``tensoropt.parallelize`` writes the graph and exits). With ``precision`` the
    model is captured as the engines will run it in that precision (``TENSOROPT_PRECISION`` in capture
    mode: cast, and under a bf16 autocast for bf16-mixed), so its ops carry the dtypes they compute in and
    the cost model prices compute and activations in them."""
    cache, key = GraphCache(), cache_key(script, args, precision)
    if use_cache and (graph := cache.load(key)) is not None and _unchanged(graph):
        return graph
    graph = run_capture(script, args, timeout_s, precision)
    if use_cache:
        cache.store(key, graph)
    return graph


def run_capture(script: str, args: list[str], timeout_s: float, precision: str | None = None) -> OpGraph:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "graph.json"
        env = {**os.environ, CAPTURE_ENV: str(out)}
        env.pop(PLAN_ENV, None)
        env.pop(PRECISION_ENV, None)
        if precision:
            env[PRECISION_ENV] = precision
        try:
            result = subprocess.run(capture_argv(script, args), env=env, capture_output=True, text=True,
                                    timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            if out.exists():
                return OpGraph.from_json(json.loads(out.read_text()))
            raise TensorOptError(f"{script} did not reach tensoropt.parallelize within {timeout_s:.0f} s while "
                                 "TensorOpt captured its model") from exc
        # the graph is written at parallelize: a script that fails on the meta device after it (past the code
        # the capture needs) still gave its model
        if not out.exists():
            last = last_line(result.stderr)
            if result.returncode == 0:
                last = "it never called tensoropt.parallelize(model, ..., example_inputs=..., global_batch=...)"
            raise TensorOptError(f"{script} failed while TensorOpt captured its model: {last}")
        return OpGraph.from_json(json.loads(out.read_text()))
