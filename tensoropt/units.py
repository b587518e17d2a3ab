"""Sizes as people write them (``40GiB``), for the command line and the Python API alike."""

from __future__ import annotations

import re

from .errors import TensorOptError

_UNITS = {"": None, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int, flag: str = "--mem") -> float:
    """'40GiB', '40 GB', '4e10B' -> bytes. A whole number without a unit ('45936257537') is a byte count,
    as everywhere else (DeepSpeed configs, torch); a fraction needs a unit."""
    text = str(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match and not match.group(2) and match.group(1).isdigit():
        return float(int(match.group(1)))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or _UNITS[unit] is None:
        raise TensorOptError(f"{flag} {text!r}: give a size with a unit, e.g. 40GiB, 80GB or 512MiB, "
                             "or a whole number of bytes")
    return float(match.group(1)) * _UNITS[unit]


__all__ = ["parse_bytes"]
