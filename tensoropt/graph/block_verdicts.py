"""Verdicts of the capture's checks of a block's first copy kept on disk, so that capturing a model again with other
depth, batch count or script options does not run its blocks again: the static tensor-parallel check
(``space.tp_check``: each branch run as one rank's share) and the runtime's layout probe
(``runtime.parallel.layout_probe``: the copy sharded as the workers shard it, on fake tensors).

A block's verdict is a function of what its first copy runs, and the key holds all of it:

- which check, and what it was given: the block's branches (the layout), whether the analysis allows sequence
  parallelism, the sequence length, the verdicts of the checks before it that its findings join;
- the block's template ops as captured (targets, shapes, dtypes, attributes, module paths): what the copy computes
  on what inputs, in which precision;
- the copy's parameters and buffers (names, shapes, dtypes, whether trained) and module classes;
- the code: the contents (not the paths) of the files defining each of the copy's module classes (a Hugging Face
  model's code sits in site-packages), of every source the capture read from outside the Python installation (the
  script and its modules, ``runtime.entry._user_sources``), and of this package (the checks' and the runtime's
  sharding code); torch's version.

A file that changes makes a new key; an old entry is never read again. Entries are JSON with a ``schema_version``,
written atomically (``cache.write_json_atomic``); one that cannot be read is a miss. In-process callers that patch
the runtime (tests) pass no cache folder.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import torch
from torch import nn

from .cache import fingerprint, write_json_atomic

SCHEMA_VERSION = 1
PACKAGE_DIR = Path(__file__).resolve().parents[1]          # tensoropt/


def block_key(check: str, copy: nn.Module, ops: tuple, sources: Iterable[str], **given) -> str:
    """The key of one check (``check``) of a block, given ``given`` (JSON-able: its layout, the verdicts before it)
    (module doc)."""
    classes = sorted({_class_file(type(m)) for m in copy.modules()} - {""})
    tensors = [[name, list(t.shape), str(t.dtype), bool(t.requires_grad)]
               for name, t in (*copy.named_parameters(), *copy.named_buffers())]
    return fingerprint({"schema_version": SCHEMA_VERSION, "check": check, "torch": torch.__version__,
                        "ops": repr(ops), "given": given, "tensors": tensors,
                        "module_classes": [type(m).__qualname__ for m in copy.modules()],
                        "code": _files_digest(tuple(sorted({*classes, *sources, *_package_files()})))})


def load(folder: Path, key: str) -> dict | None:
    """The block's entry stored under ``key`` (None: a miss)."""
    try:
        data = json.loads((folder / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    entry = data.get("entry") if isinstance(data, dict) and data.get("schema_version") == SCHEMA_VERSION else None
    return entry if isinstance(entry, dict) else None


def store(folder: Path, key: str, entry: dict) -> None:
    write_json_atomic(folder / f"{key}.json", {"schema_version": SCHEMA_VERSION, "entry": entry})


def reuse(folder: Path, keys: dict[str, str], pending: dict, verdicts: dict) -> dict[str, str]:
    """Each block of ``keys`` (block -> key) whose entry ``folder`` holds: its entry into ``verdicts``, the block out
    of ``pending`` (the blocks to run). The keys of the others, for ``keep`` once they ran."""
    missed = {}
    for name, key in keys.items():
        if (entry := load(folder, key)) is not None:
            verdicts[name] = entry
            pending.pop(name, None)
        else:
            missed[name] = key
    return missed


def keep(folder: Path, missed: dict[str, str], verdicts: dict) -> None:
    """Store the entries the blocks ``reuse`` missed got once run."""
    for name, key in missed.items():
        if name in verdicts:
            store(folder, key, verdicts[name])


def _class_file(cls: type) -> str:
    try:
        return str(Path(inspect.getfile(cls)).resolve())
    except (TypeError, OSError):          # a built-in class: its code is torch's, in the key by version
        return ""


@cache
def _package_files() -> tuple[str, ...]:
    return tuple(str(p) for p in sorted(PACKAGE_DIR.rglob("*.py")))


def _files_digest(paths: tuple[str, ...]) -> str:
    """One hash of the files' contents, whatever their paths (a copy of a script elsewhere keys alike; a file that
    cannot be read counts as its path). Each file is read once per process while its size and time are unchanged."""
    each = []
    for path in paths:
        try:
            stat = Path(path).stat()
            each.append(_file_digest(path, stat.st_size, stat.st_mtime_ns))
        except OSError:
            each.append("unreadable " + path)
    return hashlib.sha256("\n".join(sorted(each)).encode()).hexdigest()


@cache
def _file_digest(path: str, _size: int, _mtime_ns: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
