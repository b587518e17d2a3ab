"""A script's cached captures, found by the arguments they depend on (``tensoropt.runtime.capture_args``).

A capture is stored under a key of every script argument (``launcher.capture.cache_key``). The capture run
also tells which of the script's options it did not read; this index lists, per script (and interpreter,
working directory, capture version and precision), each capture with those options and its arguments without
them. A launch whose arguments, without one entry's unread options, equal that entry's reuses its graph: a
second launch with another ``--steps`` or ``--out`` does not run the script again.

The index is a hint: an entry that cannot be read, or whose graph is gone or stale, is passed over and the
script is captured again.
"""

from __future__ import annotations

import json
import re

from tensoropt.graph.cache import GraphCache, fingerprint, write_json_atomic
from tensoropt.runtime.capture_args import valid_unread

ENTRIES = 8                                     # captures kept per script, the latest first
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")     # argparse's: a value, not an option
_KEY = re.compile(r"^launch-[0-9a-f]{32}$")              # launcher.capture.cache_key's


def reduce_argv(args: list[str], unread: list[list]) -> list[str]:
    """``args`` without the ``unread`` options (``[option string, tokens it takes]``, and for a required option
    the placeholder kept in its place): ``--opt value``, ``--opt=value`` and flags, dropped only where ``argparse``
    reads them so; every other token is kept, so that two lines reduce alike only when they agree on everything
    else (a required option's presence included). Nothing after ``--`` is an option."""
    tokens = {entry[0]: entry[1] for entry in unread}
    placeholders = {entry[0]: entry[2:] for entry in unread}
    kept, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return kept + args[i:]
        count = tokens.get(arg)
        if count == 0 or (count == 1 and i + 1 < len(args) and _is_value(args[i + 1])):
            kept += placeholders[arg]
            i += 1 + count
            continue
        if "=" in arg and tokens.get(option := arg.split("=", 1)[0]) == 1:
            kept += placeholders[option]
            i += 1
            continue
        kept.append(arg)
        i += 1
    return kept


def _is_value(arg: str) -> bool:
    """Whether argparse takes ``arg`` as an option's value (else the line is one argparse refuses: kept whole, so
    that the capture shows argparse's error)."""
    return arg != "--" and (not arg.startswith("-") or arg == "-" or bool(_NEGATIVE_NUMBER.match(arg)))


class CaptureIndex:
    """The index of one script's captures (see module doc), next to the graph cache."""

    def __init__(self, cache: GraphCache, script_key: str) -> None:
        self.path = cache.dir.parent / "launch-index" / f"{script_key}.json"

    def entries(self) -> list[dict]:
        """The well-formed entries; an unreadable index is an empty one."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        entries = data.get("entries") if isinstance(data, dict) else None
        return [entry for entry in entries if _well_formed(entry)] if isinstance(entries, list) else []

    def find(self, args: list[str]) -> list[tuple[str, str]]:
        """(key, sources digest) of the captures whose arguments equal ``args`` but for options they did not
        read; the digest is of the graph's loaded files (``sources_digest``) as it was indexed, so that a graph
        stored again under the key since (by a launch that could not tell its unread options) is not taken for it."""
        return [(entry["key"], entry["sources"]) for entry in self.entries()
                if reduce_argv(args, entry["unread"]) == entry["reduced"]]

    def update(self, key: str, sources: str, args: list[str], unread: list[list] | None) -> None:
        """The capture of ``args`` just stored under ``key``: list it with the options it did not read (none when
        unknown), in place of the entries it supersedes (of this key, or of the same arguments)."""
        entries = self.entries()
        if unread is None and all(old["key"] != key for old in entries):
            return
        entry = {"key": key, "sources": sources_digest(sources), "unread": unread or [],
                 "reduced": reduce_argv(args, unread or [])}
        others = [old for old in entries
                  if old["key"] != key and (old["unread"], old["reduced"]) != (entry["unread"], entry["reduced"])]
        write_json_atomic(self.path, {"entries": ([entry] if unread is not None else []) + others[:ENTRIES - 1]})


def sources_digest(sources: str) -> str:
    """A short stand-in for a graph's ``sources`` metadata (its loaded files, sizes and times)."""
    return fingerprint({"sources": sources})


def _well_formed(entry: object) -> bool:
    """An entry as ``update`` writes it; its key names a launch capture in the cache (never a path elsewhere)."""
    return (isinstance(entry, dict) and isinstance(entry.get("key"), str) and bool(_KEY.match(entry["key"]))
            and isinstance(entry.get("sources"), str) and isinstance(entry.get("reduced"), list)
            and all(isinstance(arg, str) for arg in entry["reduced"])
            and valid_unread(entry.get("unread")))
