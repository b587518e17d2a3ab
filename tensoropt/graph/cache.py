"""On-disk cache of captured graphs, keyed by a fingerprint of the model and its inputs.

Entries are the graph's JSON, written atomically (temp file + rename) so that an interrupted
write never leaves a half-written entry; an unreadable entry counts as a miss and is rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .ir import OpGraph

# Bump when capture, op rules or the IR change what a captured graph contains (part of every cache key).
CAPTURE_VERSION = 18


def default_cache_dir() -> Path:
    """``$TENSOROPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/tensoropt``, else ``~/.cache/tensoropt``."""
    if env := os.environ.get("TENSOROPT_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tensoropt"


def fingerprint(identity: dict[str, Any]) -> str:
    """A stable hash of a JSON-able identity."""
    text = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON so that ``path`` holds either its old content or the complete new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a short temporary name: any name that fits the file system must be writable, however long
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tensoropt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class GraphCache:
    def __init__(self, root: Path | None = None) -> None:
        self.dir = (root or default_cache_dir()) / "graphs"

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def load(self, key: str) -> OpGraph | None:
        try:
            with open(self.path(key)) as f:
                return OpGraph.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: str, graph: OpGraph) -> None:
        write_json_atomic(self.path(key), graph.to_json())
