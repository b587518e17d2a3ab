"""Learn the model from the training script: run it once in capture mode, with a cache.

Capturing runs the script in a fresh Python (importing torch alone takes ~1 s), which would make
every ``--dry-run`` slow. The capture-mode run therefore lists the user's source files it loaded
(the script and every module imported from outside the Python installation) with their sizes
and modification times; a later launch with the same script, arguments and interpreter reuses
the graph if none of those files changed. It also tells which of the script's ``argparse`` options the
capture did not read (``tensoropt.runtime.capture_args``): a launch whose arguments differ from a cached
capture's only in those (``--steps``, ``--out``) reuses that capture too (``launcher.capture_index``). Data
files the script reads are not tracked: after changing one, pass ``--no-cache``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tensoropt.errors import TensorOptError, last_line
from tensoropt.graph.cache import CAPTURE_VERSION, GraphCache, fingerprint
from tensoropt.graph.ir import OpGraph
from tensoropt.runtime import CAPTURE_ENV, CAPTURE_FRESH_ENV, PLAN_ENV, PRECISION_ENV
from tensoropt.runtime.capture_args import read_report

from .argv import capture_argv
from .capture_index import CaptureIndex, sources_digest

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


def _script_identity(script: str, precision: str | None) -> dict:
    """What a capture depends on besides the script's arguments."""
    return {"script": str(Path(script).resolve()), "python": sys.executable, "cwd": os.getcwd(),
            "capture_version": CAPTURE_VERSION} | ({"precision": precision} if precision else {})


def cache_key(script: str, args: list[str], precision: str | None = None) -> str:
    return "launch-" + fingerprint(_script_identity(script, precision) | {"args": args})


def capture_script(script: str, args: list[str], use_cache: bool = True, timeout_s: float = 600,
                   precision: str | None = None) -> OpGraph:
    """The script's model graph: from the cache when its sources are unchanged, else by running it
    once in capture mode (``tensoropt.parallelize`` writes the graph and exits). With ``precision`` the
    model is captured as the engines will run it in that precision (``TENSOROPT_PRECISION`` in capture
    mode: cast, and under a bf16 autocast for bf16-mixed), so its ops carry the dtypes they compute in and
    the cost model prices compute and activations in them. The cache is looked up by every argument, then by
    the arguments each cached capture of this script read (``launcher.capture_index``)."""
    if not use_cache:
        return run_capture(script, args, timeout_s, precision)
    cache, key = GraphCache(), cache_key(script, args, precision)
    index = CaptureIndex(cache, "script-" + fingerprint(_script_identity(script, precision)))
    if (graph := _cached(cache, key)) is not None:
        return graph
    for other, digest in index.find(args):
        if (graph := _cached(cache, other)) is not None and sources_digest(graph.meta(SOURCES_META)) == digest:
            return graph
    graph, unread = _captured(script, args, timeout_s, precision)
    cache.store(key, graph)
    with contextlib.suppress(OSError):     # the index is a hint: a launch without it captures again
        index.update(key, graph.meta(SOURCES_META), args, unread)
    return graph


def _cached(cache: GraphCache, key: str) -> OpGraph | None:
    """The graph stored under ``key``, if its sources are unchanged."""
    graph = cache.load(key)
    return graph if graph is not None and _unchanged(graph) else None


def run_capture(script: str, args: list[str], timeout_s: float, precision: str | None = None) -> OpGraph:
    """The script's graph, captured now (no cache: neither a cached graph nor its blocks' cached verdicts)."""
    return _captured(script, args, timeout_s, precision, fresh=True)[0]


def _captured(script: str, args: list[str], timeout_s: float, precision: str | None = None,
              fresh: bool = False) -> tuple[OpGraph, list[list] | None]:
    """The graph the script's capture run wrote, and the options it did not read (None: unknown)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "graph.json"
        env = {**os.environ, CAPTURE_ENV: str(out)} | ({CAPTURE_FRESH_ENV: "1"} if fresh else {})
        env.pop(PLAN_ENV, None)
        env.pop(PRECISION_ENV, None)
        if precision:
            env[PRECISION_ENV] = precision
        try:
            result = subprocess.run(capture_argv(script, args), env=env, capture_output=True, text=True,
                                    timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            if out.exists():
                return OpGraph.from_json(json.loads(out.read_text())), None
            raise TensorOptError(f"{script} did not reach tensoropt.parallelize within {timeout_s:.0f} s while "
                                 "TensorOpt captured its model") from exc
        # the graph is written at parallelize: a script that fails on the meta device after it (past the code
        # the capture needs) still gave its model
        if not out.exists():
            last = last_line(result.stderr)
            if result.returncode == 0:
                last = "it never called tensoropt.parallelize(model, ..., example_inputs=..., global_batch=...)"
            raise TensorOptError(f"{script} failed while TensorOpt captured its model: {last}")
        return OpGraph.from_json(json.loads(out.read_text())), read_report(out)
