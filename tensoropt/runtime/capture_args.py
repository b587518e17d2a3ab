"""Which of the script's command-line options its capture did not depend on (capture mode only).

The launcher caches a script's captured graph; keyed by every script argument, a launch that changes only
``--steps`` or ``--out`` would capture again (~3 s). Here the capture run records, for the script's
``argparse`` options, whether the script read them before the capture ended: the launcher may then reuse the
capture for a command line that differs only in options it did not read (``launcher.capture_index``).

What counts as read, so that a reused capture is the one the script would have given:

- any option read before the graph is written at ``parallelize`` (it may shape the model, the example inputs
  or the global batch), or while it runs (the optimizer factory); reading the whole namespace (``vars(args)``,
  ``print(args)``) reads every option;
- after ``parallelize`` the graph can still change only through the autocast the script's first
  ``train_step`` runs under (captured again there). A flag or a string read there (an ``--amp`` switch,
  ``train_nanogpt.py``'s ``--dtype``) counts; a number (``type=int`` or ``float``: ``range(args.steps)``) is
  taken not to choose that autocast when the first step came and ran under none (this is an assumption: a
  script choosing its autocast by a number needs ``--no-cache`` when the number changes). Everything read
  before a first step under an autocast counts (the model may have been changed before its second capture),
  and so does everything read in a run that ended without a step (a number may have kept the step away).

Only the simple case is recorded: one parse of ``sys.argv`` into the namespace ``argparse`` makes, by a parser
with ``-`` options, no ``@file`` arguments, no sub-commands and no argument that takes the rest of the line or a
varying number of positional tokens (dropping an option before those would change what they take). Options are
dropped only if ``argparse``'s own store, flag, count or append actions parse them from none or one token and
they are neither limited to choices nor in a mutually exclusive group (so that a line the script would refuse is
refused by its capture, not by its workers). A required option (``--out``, ``required=True``) is recorded with a
placeholder, its first option string: the launcher drops its value but keeps the placeholder, so a line reuses
the capture only where it names the option too (one without it is captured, and argparse's error shown). Anything
else records nothing, and the launcher keys the capture by every argument, as without this module.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ARGS_SUFFIX = ".args.json"          # next to the capture's graph: {"unread": [[option string, tokens], ...]}
_FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
          argparse._AppendConstAction, argparse._CountAction, argparse.BooleanOptionalAction)
_VALUED = (argparse._StoreAction, argparse._AppendAction)
_WHOLE_LINE = (argparse.REMAINDER, argparse.PARSER)


@dataclass
class _Tracker:
    """The one parse this capture run tracks, and what the script read of it."""

    parses: int = 0
    parser: argparse.ArgumentParser | None = None
    namespace: object | None = None
    tracking: bool = False
    read_early: set[str] = field(default_factory=set)      # before and in parallelize
    read_late: set[str] = field(default_factory=set)       # after parallelize, before the capture ended
    everything: bool = False
    late: bool = False
    step: str = ""                                         # "plain" / "autocast": how the first step ran


_STATE = _Tracker()


class Namespace(argparse.Namespace):
    """``argparse.Namespace`` that tells the tracker which attributes the script reads (its name kept, so that
    the script prints and pickles it as usual)."""

    def __getattribute__(self, name: str):
        state = _STATE
        if state.tracking and state.namespace is self:
            if name == "__dict__":
                state.everything = True
            elif not name.startswith("__"):
                (state.read_late if state.late else state.read_early).add(name)
        return super().__getattribute__(name)


def install() -> None:
    """Track the script's parse of ``sys.argv`` (called by ``capture_run`` before the script runs)."""
    original = argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_known_args(self, args=None, namespace=None):
        if depth[0]:                                  # argparse's own nested calls (intermixed parsing)
            return original(self, args, namespace)
        _STATE.parses += 1
        tracked = namespace is None and (args is None or list(args) == sys.argv[1:])
        depth[0] += 1
        try:
            result = original(self, args, Namespace() if tracked else namespace)
        finally:
            depth[0] -= 1
        if tracked and _STATE.parses == 1:
            _STATE.parser, _STATE.namespace, _STATE.tracking = self, result[0], True
        return result

    argparse.ArgumentParser.parse_known_args = parse_known_args


def mark_parallelized() -> None:
    """The graph is written: what the script reads from now on can change it only through its first step."""
    _STATE.late = True


def mark_first_step(under_autocast: bool) -> None:
    """The capture ends at the script's first step; under an autocast it was captured again there."""
    _STATE.step = "autocast" if under_autocast else "plain"


def unread_options() -> list[list] | None:
    """[option string, tokens it takes] of each option the capture did not depend on, with a third item, the
    placeholder a reduced line keeps, for a required one; or None when this run's parse is not one it can tell
    that of (see module doc)."""
    state, parser = _STATE, _STATE.parser
    if (parser is None or state.parses != 1 or state.everything or parser.fromfile_prefix_chars
            or parser.prefix_chars != "-"):
        return None
    if any(action.nargs in _WHOLE_LINE or (not action.option_strings and not _fixed(action))
           for action in parser._actions):
        return None
    read = state.read_early | state.read_late
    if state.step == "plain":                              # numbers read after parallelize, before a plain step
        read = state.read_early | {dest for dest in state.read_late if not _numeric(parser, dest)}
    grouped = {action for group in parser._mutually_exclusive_groups for action in group._group_actions}
    return [[option, tokens, *([action.option_strings[0]] if action.required else [])]
            for action in parser._actions
            if action.option_strings and action.dest not in read and action not in grouped
            and action.choices is None and (tokens := _tokens(action)) is not None
            for option in action.option_strings]


def _tokens(action: argparse.Action) -> int | None:
    """Tokens an option takes after its option string: 0 for flags, 1 for one value, None when otherwise."""
    if type(action) in _FLAGS:                           # argparse's own: a subclass may take other tokens
        return 0
    if type(action) in _VALUED and action.nargs in (None, 1):
        return 1
    return None


def _fixed(positional: argparse.Action) -> bool:
    """A positional taking a fixed number of tokens reads the same values wherever options stand between them;
    one taking any number (``*``, ``+``, ``?``) stops at the next option, so dropping one would change it."""
    return positional.nargs is None or isinstance(positional.nargs, int)


def _numeric(parser: argparse.ArgumentParser, dest: str) -> bool:
    actions = [action for action in parser._actions if action.dest == dest]
    return bool(actions) and all(type(action) is argparse._StoreAction and action.type in (int, float)
                                 for action in actions)


def write_report(graph_path: Path) -> None:
    """Write what ``unread_options`` found next to the graph, if the capture wrote one."""
    from ..graph.cache import write_json_atomic
    with contextlib.suppress(Exception):     # a hint: without it the launcher keys the capture by every argument
        unread = unread_options()
        if unread is not None and graph_path.exists():
            write_json_atomic(Path(str(graph_path) + ARGS_SUFFIX), {"unread": unread})


def read_report(graph_path: Path) -> list[list] | None:
    """The unread options a capture run recorded next to its graph, or None."""
    try:
        data = json.loads(Path(str(graph_path) + ARGS_SUFFIX).read_text())
    except (OSError, ValueError):
        return None
    unread = data.get("unread") if isinstance(data, dict) else None
    return unread if valid_unread(unread) else None


def valid_unread(unread: object) -> bool:
    """Whether ``unread`` is a list of [option string, 0 or 1] or [option string, 0 or 1, placeholder] (as
    ``unread_options`` gives)."""
    return isinstance(unread, list) and all(
        isinstance(entry, list) and len(entry) in (2, 3) and all(_option(item) for item in entry[::2])
        and type(entry[1]) is int and entry[1] in (0, 1) for entry in unread)


def _option(item: object) -> bool:
    return isinstance(item, str) and item.startswith("-")
