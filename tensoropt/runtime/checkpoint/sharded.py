"""Sharded, atomic, verified checkpoints of model and optimizer: the torch engine's (``search.engines.CHECKPOINTS``).

Each rank writes its own shards with ``torch.distributed.checkpoint`` (DCP): a checkpoint saved by 2 FSDP2 ranks
loads into 1 DDP rank or a plain model, because DCP reshards by parameter name on load. The files and their checks
are ``checkpoint.files``'s; here the ranks write and read them together:

- save: every rank writes into ``.step-N.partial``; the ranks then take the size and SHA-256 of its files (each
  rank a share, read back from the file system), rank 0 writes them into its ``manifest.json``, renames it to
  ``step-N`` (atomic), checks that every file is there at its size, points ``latest.json`` at it (atomic), and
  only then removes the older checkpoints beyond the newest ``keep`` (``--keep-checkpoints``). A crash at any
  moment leaves ``latest.json`` naming a whole checkpoint, or none.
- a save that cannot be written (the disk full, a file-size limit, no permission) is a ``CheckpointError`` on every
  rank: one line naming the directory, the bytes the checkpoint needs and the bytes free there; the partial one is
  removed and ``latest.json`` left as it was, so the last good checkpoint stays the latest. Rank 0 compares the
  free space with the checkpoint's bytes before each save, so a full disk is usually said before anything is
  written.
- load: the checkpoints ``checkpoint.files.candidates`` offers, newest first; the ranks check each one's files
  together (each rank a share, by size and SHA-256) and load the first whole one. Each one skipped, and a
  ``latest.json`` that names nothing, is one line on rank 0's stderr naming the file and what is wrong with it.
  A whole checkpoint that DCP cannot load into this model (another model's) is a ``CheckpointError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import sys
from pathlib import Path

from torch import nn

from ...errors import CheckpointError, first_line
from ...graph.cache import write_json_atomic
from .files import (
    HEADER_BYTES,
    KEEP,
    LATEST,
    MANIFEST,
    SCHEMA_VERSION,
    candidates,
    digest,
    dir_name,
    manifest,
    partial_name,
    problem,
    prune,
)

CRASH_ENV = "TENSOROPT_CRASH_IN_CHECKPOINT"  # fault injection for tests: die mid-save at this step
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
BAD: set[str] = set()        # step folders this process found damaged: never counted as a fallback when pruning


def _dist():
    import torch.distributed as dist
    return dist if dist.is_initialized() else None


def _rank() -> int:
    return dist.get_rank() if (dist := _dist()) else 0


def _all_gather(value) -> list:
    """``value`` from every rank, in rank order (``[value]`` alone)."""
    if not (dist := _dist()):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class _Failed(Exception):
    """A step of a save failed on some rank: what every rank then raises (errno, words)."""

    def __init__(self, code: int | None, words: str):
        super().__init__(words)
        self.code = code


def _on_rank0(fn) -> None:
    """Run ``fn`` on rank 0; an ``OSError`` (or ``_Failed``) there is raised as ``_Failed`` on every rank."""
    failure = None
    if _rank() == 0:
        try:
            fn()
        except _Failed as exc:
            failure = (exc.code, str(exc))
        except OSError as exc:
            failure = (exc.errno, _words(exc))
    if failure := next((f for f in _all_gather(failure) if f), None):
        raise _Failed(*failure)


def _words(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" + (f" ({exc.filename})" if exc.filename else "") \
        if exc.errno else first_line(exc)


class _RecordedFileSystem:
    """DCP's file system with every ``OSError`` of its streams noted: torch.save's zip writer turns a failed write
    into a RuntimeError without its errno ("unexpected pos"), the note keeps what the file system said."""

    def __init__(self, base, errors: list):
        self._base, self._errors = base, errors

    def __getattr__(self, name):
        return getattr(self._base, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        try:
            with self._base.create_stream(path, mode) as stream:
                yield _RecordedStream(stream, self._errors)
        except OSError as exc:
            self._errors.append((exc.errno, _words(exc)))
            raise


class _RecordedStream:
    def __init__(self, stream, errors: list):
        self._stream, self._errors = stream, errors

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as exc:
            self._errors.append((exc.errno, _words(exc)))
            raise


def _state(model: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def state_bytes(state) -> int:
    """What a checkpoint of ``state`` needs on disk over all ranks: each tensor's bytes (a DTensor's whole global
    size) and ``HEADER_BYTES`` per item DCP writes (a DTensor: one per rank of its mesh), as the launcher counts them
    from the plan (``launcher.checkpoints``)."""
    import torch
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if not isinstance(state, torch.Tensor):
        return 0
    mesh = getattr(state, "device_mesh", None)
    return state.numel() * state.element_size() + HEADER_BYTES * (mesh.size() if mesh is not None else 1)


def _in_model_order(state: dict, model: nn.Module) -> dict:
    """What DCP reads and writes: ``state`` with fused projections held in another feature order by this run
    (``feature_order``) as chunks in the model's own order, so checkpoints reshard onto any plan."""
    from ..parallel.feature_order import feature_orders, in_model_order_chunks
    orders = feature_orders(model)
    return {key: in_model_order_chunks(value, orders) for key, value in state.items()} if orders else state


def save(directory: Path, step: int, model: nn.Module, optimizer, keep: int = KEEP) -> None:
    """Write the state after ``step`` as ``directory/step-N``, make it the latest and keep the newest ``keep``
    (all ranks call); a ``CheckpointError`` on every rank when it cannot be written (module doc)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    directory = Path(directory)
    partial, final = directory / partial_name(step), directory / dir_name(step)
    state = _state(model, optimizer)
    needed, recorded, done = state_bytes(state), [], set()       # done: "renamed", "committed" (rank 0's stages)
    try:
        _on_rank0(lambda: _prepare(directory, partial, needed))
        writer = dcp.FileSystemWriter(str(partial))
        writer.fs = _RecordedFileSystem(writer.fs, recorded)
        try:
            dcp.save(_in_model_order(state, model), storage_writer=writer)
        except CheckpointException as exc:
            raise _failed(exc, _all_gather(recorded[0] if recorded else None)) from None
        if os.environ.get(CRASH_ENV) == str(step):
            os._exit(17)                                                   # a worker dies after writing its shards
        files = _file_digests(partial)
        _on_rank0(lambda: _commit(directory, partial, final, step, files, keep, done))
    except _Failed as exc:
        if _rank() == 0 and "committed" not in done:        # the torn one goes; latest.json names what it named
            shutil.rmtree(partial, ignore_errors=True)
            if "renamed" in done:
                shutil.rmtree(final, ignore_errors=True)
        raise CheckpointError(_no_room_words(directory, step, needed, exc)) from None


def _prepare(directory: Path, partial: Path, needed: int) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if shutil.disk_usage(directory).free < needed:
        raise _Failed(errno.ENOSPC, f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} (checked before writing)")


def _file_digests(partial: Path) -> dict:
    """Size and SHA-256 of every file DCP wrote, each rank a share, gathered on every rank."""
    import torch.distributed as dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if _dist() else (0, 1)
    names = sorted(p.name for p in partial.iterdir() if p.is_file())
    mine, failure = {}, None
    try:
        mine = {name: digest(partial / name) for name in names[rank::world]}
    except OSError as exc:
        failure = (exc.errno, _words(exc))
    gathered = _all_gather((mine, failure))
    if failure := next((f for _, f in gathered if f), None):
        raise _Failed(*failure)
    return {name: entry for share, _ in gathered for name, entry in share.items()}


def _commit(directory: Path, partial: Path, final: Path, step: int, files: dict, keep: int, done: set) -> None:
    """Rank 0 publishes the checkpoint written in ``partial``: its manifest, the rename, a check of every file's
    size, ``latest.json``, and only then the removal of older ones (module doc). ``done`` notes how far it got."""
    write_json_atomic(partial / MANIFEST, manifest(step, files))
    shutil.rmtree(final, ignore_errors=True)            # an older save of this step (one this run skipped as damaged)
    os.replace(partial, final)
    done.add("renamed")
    if trouble := problem(final, deep=False):
        raise _Failed(None, f"{trouble}, right after it was written")
    write_json_atomic(directory / LATEST, {"schema_version": SCHEMA_VERSION, "step": step, "path": final.name})
    done.add("committed")
    BAD.discard(final.name)
    prune(directory, step, keep, frozenset(BAD))


def _failed(exc, recorded: list) -> _Failed:
    """The first rank's failure of a DCP save: what its file system said, else the exception DCP gathered."""
    if noted := next((r for r in recorded if r), None):
        return _Failed(*noted)
    for _rank_failed, (cause, _trace) in sorted(exc.failures.items()):
        if isinstance(cause, OSError):
            return _Failed(cause.errno, _words(cause))
    _, (cause, _) = min(exc.failures.items())
    return _Failed(None, f"{type(cause).__name__}: {first_line(cause)}")


def _no_room_words(directory: Path, step: int, needed: int, exc: _Failed) -> str:
    try:
        free = f"{shutil.disk_usage(directory).free:,}"
    except OSError:
        free = "?"
    cause = str(exc)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if exc.code == errno.EFBIG and limit != resource.RLIM_INFINITY:
        cause += f" (this process's file-size limit, ulimit -f, is {limit:,} bytes)"
    found = candidates(directory)[0]
    last = f"the latest checkpoint, {found[0].path.name}, is untouched" if found else "no earlier checkpoint there"
    change = {errno.EFBIG: "raise the file-size limit (ulimit -f) or point --checkpoint-dir at a file system that "
                           "takes larger files"}.get(exc.code, "free space there, point --checkpoint-dir at a larger "
                                                    "disk or keep fewer (--keep-checkpoints)") \
        if exc.code in NO_ROOM else "point --checkpoint-dir at a folder this job can write"
    return (f"checkpoint of step {step} could not be written to {directory}: {cause}; it needs {needed:,} bytes, "
            f"{free} are free there: {change}; {last}")


def _say(line: str) -> None:
    if _rank() == 0:
        print(f"checkpoint: {line}", file=sys.stderr, flush=True)


def load(directory: Path, model: nn.Module, optimizer) -> int:
    """Load the newest whole checkpoint into the (already parallelized) model and optimizer; returns its step, 0
    when there is none. The target's own state dict is the template: DCP fills each rank's shards from whatever
    layout saved them. Every checkpoint skipped is one line (module doc)."""
    directory = Path(directory)
    found, skipped = candidates(directory)
    for candidate in found:
        if (trouble := _problem(candidate.path)) is None:
            _load(candidate.path, model, optimizer)
            for line in skipped:
                _say(f"{line}; resuming from step {candidate.step} ({candidate.path})")
            return candidate.step
        BAD.add(candidate.path.name)
        skipped.append(f"skipping step {candidate.step}: {trouble}")
    for line in skipped:
        _say(f"{line}; no whole checkpoint left in {directory}: starting from step 0")
    return 0


def _problem(path: Path) -> str | None:
    """What is wrong with the checkpoint at ``path``, checked by all ranks together (each a share of its files)."""
    share = (_rank(), _dist().get_world_size() if _dist() else 1)
    return next((p for p in _all_gather(problem(path, deep=True, share=share)) if p), None)


def _load(path: Path, model: nn.Module, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = _state(model, optimizer)
    try:
        dcp.load(_in_model_order(state, model), checkpoint_id=str(path))     # fills ``state``'s tensors in place
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (CheckpointException, RuntimeError, KeyError, ValueError) as exc:
        failures = getattr(exc, "failures", None)
        cause = min(failures.items())[1][0] if failures else exc
        raise CheckpointError(f"checkpoint {path} is whole but does not load into this model ({type(cause).__name__}: "
                              f"{first_line(cause, 200)}): point --checkpoint-dir at this model's checkpoints, or at "
                              "an empty folder to start afresh") from None


__all__ = ["BAD", "CRASH_ENV", "KEEP", "load", "save", "state_bytes"]
