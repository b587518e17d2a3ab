"""Sizes as people write them (``40GiB``), for the command line and the Python API alike."""

from __future__ import annotations

import re

from .errors import TensorOptError

# a size per device above this is a typo (a unit missing or doubled): no device holds a pebibyte
MAX_BYTES = 2**50

_UNITS = {"": None, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "pb": 1e15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int, flag: str = "--mem") -> float:
    """'40GiB', '40 GB', '4e10B' -> bytes. A whole number without a unit ('45936257537') is a byte count,
    as everywhere else (DeepSpeed configs, torch); a fraction needs a unit. A size must be above 0 and at most
    ``MAX_BYTES``."""
    text = str(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match and not match.group(2) and match.group(1).isdigit():
        size = float(int(match.group(1)))
    elif not match or unit not in _UNITS or _UNITS[unit] is None:
        raise TensorOptError(f"{flag} {text!r}: give a size with a unit, e.g. 40GiB, 80GB or 512MiB, "
                             "or a whole number of bytes")
    else:
        size = float(match.group(1)) * _UNITS[unit]
    if not 0 < size <= MAX_BYTES:
        raise TensorOptError(f"{flag} {text!r}: give a size above 0 and at most 1 PiB per device, e.g. 40GiB")
    return size


__all__ = ["MAX_BYTES", "parse_bytes"]
