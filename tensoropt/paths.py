"""Output paths, checked before any work starts.

A command that measures for 18 s or searches for a minute and then cannot write its result has wasted
that time, and one that writes one output and then fails on the next leaves half a result. So every
output a command will write (``--out``, ``--plot``, ``--run-dir``, ``--checkpoint-dir``) is checked
where the command starts: its folder exists (or, for a folder, can be made), is writable in fact
(a probe file is created and removed: permission bits say nothing on ``/proc`` or a read-only mount),
the name fits the file system, and a file is not a folder nor a folder a file. The writes themselves
are atomic (``graph.cache.write_json_atomic``, ``atomic_output``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import TensorOptError, first_line

# matplotlib writes these without extra packages; the plot's format is its file's suffix
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
TEMP_PREFIX = ".tensoropt-"          # short: a temporary file's name must fit wherever the output's name fits


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _probe(folder: Path, flag: str, path: Path) -> None:
    """Create and remove a file in ``folder``: the only sure test that the command will be able to write."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=".probe")
    except OSError as exc:
        raise TensorOptError(f"{flag} {path}: cannot write in {folder} ({first_line(exc)}): choose another "
                             "place") from None
    os.close(fd)
    Path(name).unlink(missing_ok=True)


def _check_names(path: Path, flag: str, folder: Path) -> None:
    longest = _name_max(folder)
    for part in path.parts:
        if len(os.fsencode(part)) > longest:
            raise TensorOptError(f"{flag}: the name {part[:40]}... is {len(os.fsencode(part))} bytes long, more than "
                                 f"the {longest} this file system allows: choose a shorter name")


def check_output_file(path: str | Path, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` as a file the command can write (see module doc), else a one-line ``TensorOptError`` naming
    ``flag``; ``suffixes``: the endings allowed (a plot's format)."""
    path = Path(path)
    _check_names(path, flag, Path(path.anchor or "."))      # first: a name too long fails every other test
    if suffixes and path.suffix.lower() not in suffixes:
        raise TensorOptError(f"{flag} {path}: name a {' or '.join(s[1:].upper() for s in suffixes)} file "
                             f"(ending in {', '.join(suffixes)})")
    folder = path.parent
    if path.is_dir():
        raise TensorOptError(f"{flag} {path} is a folder: name a file in it")
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise TensorOptError(f"{flag} {path}: the folder {folder} {what}: create the folder or choose another path")
    _probe(folder, flag, path)
    return path


def check_output_dir(path: str | Path, flag: str) -> Path:
    """``path`` as a folder the command can write into, made later if missing (see module doc): not a file,
    under an existing folder that is writable, with names the file system allows; else one line naming ``flag``."""
    path = Path(path)
    _check_names(path, flag, Path(path.anchor or "."))
    if path.exists() and not path.is_dir():
        raise TensorOptError(f"{flag} {path} is a file, not a folder: name a folder (it is created if missing)")
    existing = path
    while not existing.exists():                  # the deepest folder that exists: where the new ones are made
        existing = existing.parent
    if not existing.is_dir():
        raise TensorOptError(f"{flag} {path}: {existing} is a file, not a folder")
    _probe(existing, flag, path)
    return path


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write to; moved onto ``path`` when the block ends without an
    error, removed otherwise, so ``path`` holds its old content or the complete new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["PLOT_SUFFIXES", "atomic_output", "check_output_dir", "check_output_file"]
