"""Human-readable numbers for tables."""

from __future__ import annotations


def si(value: float, unit: str = "") -> str:
    """1.746e11 -> '174.6 G' + unit (powers of 1000)."""
    for factor, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}".rstrip()


def count(value: float) -> str:
    """1.746e11 -> '174.6B' (parameter counts)."""
    for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.4g}{suffix}"
    return str(int(value))


def binary_bytes(value: float) -> str:
    """3.2e10 -> '29.8 GiB' (powers of 1024)."""
    for factor, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= factor:
            return f"{value / factor:.4g} {unit}"
    return f"{int(value)} B"
