"""The ``tensoropt`` command line: a thin layer over the library (the commands: ``group``).

``main`` imports the commands (and with them torch, ~1-2 s) inside its own guard, so a Ctrl-C at any moment,
while modules import too, ends the command with one line and exit status 130 instead of a traceback.
"""

from __future__ import annotations

import sys

INTERRUPTED_STATUS = 130                # 128 + SIGINT, as a shell reports a process stopped by Ctrl-C


def interrupted() -> None:
    """Leave as a Ctrl-C should: one line, exit status 130."""
    sys.stderr.write("interrupted\n")
    sys.exit(INTERRUPTED_STATUS)


def main() -> None:
    try:
        from .group import cli
        status = cli.main(prog_name="tensoropt", standalone_mode=True)
    except KeyboardInterrupt:
        interrupted()
    sys.exit(status)


def __getattr__(name: str):
    """``tensoropt.cli.cli``, the click group, imported on first use."""
    if name == "cli":
        from .group import cli
        return cli
    raise AttributeError(f"module 'tensoropt.cli' has no attribute {name!r}")
