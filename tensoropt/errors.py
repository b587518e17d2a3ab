"""User-facing errors.

A ``TensorOptError`` is a mistake the user can fix; its message is one line that says what to
change. The CLI prints it without a stack trace and exits non-zero; anything else is a bug.
"""


class TensorOptError(Exception):
    """An error in the user's input, reported as one line."""


class CaptureError(TensorOptError):
    """The model could not be captured into an operator graph."""


class ModelSpecError(TensorOptError):
    """The ``--model`` argument names nothing TensorOpt can build."""
