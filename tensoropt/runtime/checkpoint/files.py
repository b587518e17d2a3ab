"""The files of a checkpoint directory, read without torch: which checkpoints are there, whether one is whole, which
to keep. ``runtime.checkpoint.sharded`` writes and loads them in the workers; the launcher reads them here.

A checkpoint directory::

    latest.json                {"schema_version": 1, "step": 6, "path": "step-00000006"}: the newest committed one
    step-00000006/             one checkpoint: each rank's DCP shards (__R_I.distcp), DCP's .metadata, manifest.json
    step-00000004/             an older one, kept as the fallback (``--keep-checkpoints``, default 2)
    .step-00000008.partial/    one being written, or torn by a crash: never read, removed by the next save

``manifest.json`` (``{"schema_version": 1, "step": 6, "files": {name: {"bytes": n, "sha256": hex}}}``) holds every
file's size and SHA-256 (``sha256sum`` checks them by hand), taken from the files as written back from the file
system: it is written into the checkpoint before the rename that publishes it, so a ``step-N`` folder without one
is not a checkpoint TensorOpt finished. Before a checkpoint is loaded every file is checked against it (``problem``):
a file missing, truncated or grown, or with other bytes than were saved, and the checkpoint is skipped for the next
older one. ``latest.json`` is the commit: a checkpoint newer than the one it names is never loaded (it may be the
torn end of a crash); one it names that is not there, or a ``latest.json`` that is unreadable, falls back to the
``step-N`` folders, newest first.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

LATEST, MANIFEST = "latest.json", "manifest.json"
SCHEMA_VERSION = 1
KEEP = 2                                  # complete checkpoints kept by default (``--keep-checkpoints``)
# DCP's bytes beyond the tensors' own per item it writes (each rank's shard of a tensor): torch.save's zip record of
# it and its entry in .metadata; 1,811 on average on examples/train_gpt.py's checkpoints (684,428 bytes over 378
# items), rounded up (``launcher.checkpoints``, ``checkpoint.state_bytes``)
HEADER_BYTES = 2048
CHUNK_BYTES = 1 << 22                     # read 4 MiB at a time: the whole of a shard is never in memory
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Candidate:
    """A ``step-N`` folder that may hold a checkpoint."""

    step: int
    path: Path


def dir_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_name(step: int) -> str:
    return f".step-{step:08d}.partial"


def step_dirs(directory: Path) -> list[Candidate]:
    """The ``step-N`` folders in ``directory``, oldest first."""
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    found = [Candidate(int(m.group(1)), p) for p in entries if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found, key=lambda c: c.step)


def candidates(directory: Path) -> tuple[list[Candidate], list[str]]:
    """The checkpoints to try, newest first, and what is wrong with ``latest.json`` (at most one line; none for a
    directory with no checkpoint at all): the one it names, then the older ones; every ``step-N`` folder when it
    is missing, unreadable or names nothing there (below the step it names, when it names one)."""
    directory = Path(directory)
    found = step_dirs(directory)
    latest = directory / LATEST
    try:
        data = json.loads(latest.read_text())
        step, name = int(data["step"]), str(data["path"])
    except FileNotFoundError:
        return found[::-1], [f"{latest}: missing"] if found else []
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return found[::-1], [f"{latest}: not readable ({type(exc).__name__}: {exc})"[:300]]
    named = directory / name
    if "/" in name or not named.is_dir():
        return [c for c in found if c.step < step][::-1], [f"{latest} names {name}, which is not there"]
    return [Candidate(step, named)] + [c for c in found if c.step < step][::-1], []


def digest(path: Path) -> dict:
    """A file's size and SHA-256, as the manifest records them."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def manifest(step: int, files: dict[str, dict]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "step": step, "files": dict(sorted(files.items()))}


def read_manifest(path: Path) -> dict | str:
    """The manifest of the checkpoint at ``path``, or what is wrong with it (one line)."""
    where = path / MANIFEST
    try:
        data = json.loads(where.read_text())
    except FileNotFoundError:
        return f"{where}: missing (a checkpoint TensorOpt did not finish)"
    except (OSError, ValueError) as exc:
        return f"{where}: not readable ({type(exc).__name__}: {exc})"[:300]
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION or \
            not isinstance(data.get("files"), dict):
        version = data.get("schema_version") if isinstance(data, dict) else None
        return f"{where}: not a manifest this TensorOpt reads (schema_version {version}, expected {SCHEMA_VERSION})"
    return data


def file_problem(path: Path, name: str, want: dict, deep: bool = True) -> str | None:
    """What is wrong with one file of a checkpoint against its manifest entry ``want``; ``deep``: its checksum
    too, not only its size."""
    file = path / name
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return f"{file}: missing"
    except OSError as exc:
        return f"{file}: not readable ({exc.strerror})"
    if size != want.get("bytes"):
        how = "truncated" if size < want.get("bytes", 0) else "longer than saved"
        return f"{file}: {size:,} bytes, {want.get('bytes', 0):,} when saved ({how})"
    if deep:
        try:
            same = digest(file)["sha256"] == want.get("sha256")
        except OSError as exc:
            return f"{file}: not readable ({exc.strerror})"
        if not same:
            return f"{file}: its SHA-256 differs from the one saved (damaged bytes)"
    return None


def problem(path: Path, deep: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with the checkpoint at ``path`` (the first problem found, one line), None when it is whole:
    its manifest, then every file it lists (``share`` ``(i, n)``: only every n-th file from the i-th, for ranks to
    check a checkpoint together), by size, and with ``deep`` by SHA-256 too."""
    data = read_manifest(path)
    if isinstance(data, str):
        return data
    names = sorted(data["files"])[share[0]::share[1]]
    return next((p for name in names if (p := file_problem(path, name, data["files"][name], deep))), None)


def latest_step(directory: Path) -> int:
    """The step a resumed run starts from: the newest checkpoint that ``candidates`` offers whose files are all
    there at their saved sizes (the workers check their bytes too, and may fall back further); 0 when none."""
    return next((c.step for c in candidates(directory)[0] if problem(c.path, deep=False) is None), 0)


def complete_count(directory: Path) -> int:
    """How many whole checkpoints (by size) the directory holds."""
    return sum(problem(c.path, deep=False) is None for c in step_dirs(directory))


def prune(directory: Path, newest: int, keep: int, bad: frozenset[str] = frozenset()) -> None:
    """After checkpoint ``newest`` is committed: keep it and the newest ``keep - 1`` older whole ones (not in
    ``bad``: found damaged by this process), remove the other older ones and every torn ``.partial`` folder.
    Newer folders than ``newest`` (skipped ones a resumed run will write again) are left alone."""
    whole = [c for c in step_dirs(directory) if c.step < newest and c.path.name not in bad
             and problem(c.path, deep=False) is None]
    kept = {c.path for c in whole[len(whole) - (keep - 1):]} if keep > 1 else set()
    for c in step_dirs(directory):
        if c.step < newest and c.path not in kept:
            shutil.rmtree(c.path, ignore_errors=True)
    for torn in Path(directory).glob(".step-*.partial"):
        shutil.rmtree(torn, ignore_errors=True)


__all__ = ["HEADER_BYTES", "KEEP", "LATEST", "MANIFEST", "SCHEMA_VERSION", "Candidate", "candidates",
           "complete_count", "digest", "dir_name", "file_problem", "latest_step", "manifest", "partial_name", "problem",
           "prune", "read_manifest", "step_dirs"]
