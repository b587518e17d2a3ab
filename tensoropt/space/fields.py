"""Reading the fields of a plan file strictly: a wrong type or value is one line naming the field.

plan.json is written by the launcher and may be edited by hand (``--plan``). ``int("2")`` or ``bool("no")``
would read a mistyped field as something else than what was written, so each reader checks the JSON type
(``True`` is not an integer here, ``1`` is not a boolean) and raises ``ValueError`` with the field's path;
``RunPlan.from_json`` turns that into a ``TensorOptError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MISSING: Any = object()


def _value(d: Mapping, key: str, default: Any, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where or 'the plan'} must be a JSON object, got {type(d).__name__}")
    if key in d:
        return d[key]
    if default is MISSING:
        raise ValueError(f"field {_path(where, key)!r} is missing")
    return default


def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def integer(d: Mapping, key: str, default: Any = MISSING, minimum: int | None = None, where: str = "") -> int:
    """``d[key]`` as an int (a JSON integer, not a boolean), at least ``minimum``."""
    value = _value(d, key, default, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {_path(where, key)!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"field {_path(where, key)!r} must be at least {minimum}, got {value}")
    return value


def number(d: Mapping, key: str, default: Any = MISSING, where: str = "") -> float:
    """``d[key]`` as a float (a JSON integer or float, not a boolean)."""
    value = _value(d, key, default, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {_path(where, key)!r} must be a number, got {value!r}")
    return float(value)


def boolean(d: Mapping, key: str, default: Any = MISSING, where: str = "") -> bool:
    """``d[key]`` as a bool (JSON true or false only)."""
    value = _value(d, key, default, where)
    if not isinstance(value, bool):
        raise ValueError(f"field {_path(where, key)!r} must be true or false, got {value!r}")
    return value


def text(d: Mapping, key: str, default: Any = MISSING, choices: Sequence[str] = (), where: str = "") -> str:
    """``d[key]`` as a str, one of ``choices`` when they are given."""
    value = _value(d, key, default, where)
    if not isinstance(value, str):
        raise ValueError(f"field {_path(where, key)!r} must be a string, got {value!r}")
    if choices and value not in choices:
        raise ValueError(f"field {_path(where, key)!r} is {value!r}, not one of {', '.join(map(repr, choices))}")
    return value


def strings(d: Mapping, key: str, default: Any = MISSING, where: str = "") -> tuple[str, ...]:
    """``d[key]`` as a tuple of str (a JSON list of strings)."""
    value = _value(d, key, default, where)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"field {_path(where, key)!r} must be a list of strings, got {value!r}")
    return tuple(value)


def integers(d: Mapping, key: str, default: Any = MISSING, where: str = "") -> tuple[int, ...]:
    """``d[key]`` as a tuple of int (a JSON list of integers)."""
    value = _value(d, key, default, where)
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ValueError(f"field {_path(where, key)!r} must be a list of integers, got {value!r}")
    return tuple(value)


def objects(d: Mapping, key: str, default: Any = MISSING, where: str = "") -> list[Mapping]:
    """``d[key]`` as a list of JSON objects."""
    value = _value(d, key, default, where)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, Mapping) for v in value):
        raise ValueError(f"field {_path(where, key)!r} must be a list of objects, got {value!r}")
    return list(value)


def mapping(d: Mapping, key: str, default: Any = MISSING, where: str = "") -> Mapping:
    """``d[key]`` as a JSON object."""
    value = _value(d, key, default, where)
    if not isinstance(value, Mapping):
        raise ValueError(f"field {_path(where, key)!r} must be an object, got {value!r}")
    return value


def only(d: Mapping, known: Sequence[str], where: str = "") -> None:
    """Refuse a key outside ``known``: a misspelt field would otherwise be ignored and its default run."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where or 'the plan'} must be a JSON object, got {type(d).__name__}")
    if unknown := [k for k in d if k not in known]:
        raise ValueError(f"unknown field {_path(where, unknown[0])!r} (known: {', '.join(known)})")


__all__ = ["MISSING", "boolean", "integer", "integers", "mapping", "number", "objects", "only", "strings", "text"]
