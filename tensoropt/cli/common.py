"""Options and argument parsing shared by the planning commands."""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass

import click

from ..api import capture
from ..cost.model import ModelCost
from ..cost.profile import Cluster, DeviceProfile, load_profile
from ..errors import TensorOptError
from ..graph.fold import FoldedGraph, fold
from ..graph.ir import OpGraph

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


def parse_gpus(text: str) -> list[int]:
    """'8' -> [8]; '64,128,256' -> those; '64-1024' -> 64, 128, ..., 1024 (doubling)."""
    try:
        if "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            if low < 1 or high < low:
                raise ValueError
            counts = []
            while low <= high:
                counts.append(low)
                low *= 2
            return counts
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
        if not counts or counts[0] < 1:
            raise ValueError
        return counts
    except ValueError:
        raise TensorOptError(f"--gpus {text!r}: give a count (8), a list (64,128,256) or a range (64-1024)") from None


@dataclass
class Loaded:
    graph: OpGraph
    folded: FoldedGraph
    profile: DeviceProfile
    capture_seconds: float

    def model_cost(self, devices: int, per_node: int) -> ModelCost:
        return ModelCost(self.graph, self.folded, Cluster(devices, min(per_node, devices), self.profile))

    @property
    def folding(self) -> dict:
        return self.folded.summary()


def load(model: str, device: str, seq_len: int | None, dtype: str | None = None) -> Loaded:
    profile = load_profile(device)
    captured = capture(model, seq_len=seq_len, dtype=dtype)
    loaded = Loaded(captured.graph, fold(captured.graph), profile, captured.capture_seconds)
    # the graph lives as long as this command: keep the collector from walking its ~10^5 objects during the
    # search (a full collection there cost gpt3-175b's search ~70 ms, a third of it)
    gc.freeze()
    return loaded


def model_options(func):
    func = click.option("--seq-len", type=int, default=None, help="sequence length (default: the model's)")(func)
    func = click.option("--device", "device", default="h100-80gb", show_default=True,
                        help="device profile: a name in profiles/ or a path to a profile JSON")(func)
    func = click.option("--gpus-per-node", type=int, default=8, show_default=True)(func)
    return func
