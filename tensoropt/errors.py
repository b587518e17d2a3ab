"""User-facing errors, and how they are reported: one line.

A ``TensorOptError`` is a mistake the user can fix; its message is one line that says what to
change. The CLI prints it without a stack trace and exits non-zero; anything else is a bug.
Messages that quote another program's or library's text (an ``OSError``, a worker's stderr) keep
one line of it: ``first_line`` for an exception (its summary comes first), ``last_line`` for a
process's output (its final line says why it stopped), so that every error the user sees is
``error: <what to change>`` on one line.
"""

from __future__ import annotations

# a quoted line longer than this is cut: the point is the cause, not the whole dump
QUOTE_CHARS = 300


class TensorOptError(Exception):
    """An error in the user's input, reported as one line."""


class CaptureError(TensorOptError):
    """The model could not be captured into an operator graph."""


class ModelSpecError(TensorOptError):
    """The ``--model`` argument names nothing TensorOpt can build."""


class CheckpointError(TensorOptError):
    """A checkpoint could not be written, or a whole one not loaded: a worker stops with this line
    (``runtime.run.exit_on_checkpoint_error``), and the launcher says it (``launcher.launch.run_workers``)."""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(error: BaseException | str, limit: int = QUOTE_CHARS) -> str:
    """The first non-empty line of an exception's message (its type name if it has none), cut to ``limit``."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__ if isinstance(error, BaseException) else "(no message)"
    return _cut(lines[0], limit)


def last_line(output: str, limit: int = QUOTE_CHARS) -> str:
    """The last non-empty line of a process's output, cut to ``limit``; ``(no output)`` when there is none."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return _cut(lines[-1], limit) if lines else "(no output)"


def one_line(message: str) -> str:
    """``message`` joined into one line: a user error must never spill over several."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def error_line(message: BaseException | str) -> str:
    """What the command line prints for an error: ``error: <message on one line>``."""
    text = one_line(str(message)) or (type(message).__name__ if isinstance(message, BaseException) else "")
    return f"error: {text}"
