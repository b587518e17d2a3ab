"""Options and argument parsing shared by the planning commands (the bounds and limit flags they share with
``tensoropt launch`` are in ``tensoropt.options``)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import click

from ..cost.model import ModelCost
from ..cost.profile import Cluster, DeviceProfile, load_profile
from ..errors import TensorOptError
from ..graph.fold import FoldedGraph, fold
from ..graph.ir import OpGraph
from ..options import MAX_DEVICES_PER_NODE, check_counts


def parse_gpus(text: str) -> list[int]:
    """'8' -> [8]; '64,128,256' -> those; '64-1024' -> 64, 128, ..., 1024 (doubling)."""
    try:
        if "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            if low < 1 or high < low:
                raise ValueError
            check_counts(devices=high)
            counts = []
            while low <= high:
                counts.append(low)
                low *= 2
        else:
            counts = sorted({int(x) for x in text.split(",") if x.strip()})
        if not counts or counts[0] < 1:
            raise ValueError
    except ValueError:
        raise TensorOptError(f"--gpus {text!r}: give a count (8), a list (64,128,256) or a range (64-1024)") from None
    check_counts(devices=counts[-1])
    return counts


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


def load(model: str, device: str, seq_len: int | None, dtype: str | None = None,
         precision: str | None = None) -> Loaded:
    """``model`` captured in ``dtype``, or in ``precision`` as the launcher captures a script in it
    (``tensoropt.capture``), on ``device``'s profile."""
    profile = load_profile(device)
    from ..api import capture  # with torch: a graph from the cache is read without it (graph.cache)
    captured = capture(model, seq_len=seq_len, dtype=dtype, precision=precision)
    loaded = Loaded(captured.graph, fold(captured.graph), profile, captured.capture_seconds)
    # the graph lives as long as this command: keep the collector from walking its ~10^5 objects during the
    # search (a full collection there cost gpt3-175b's search ~70 ms, a third of it)
    gc.freeze()
    return loaded


def model_options(func):
    func = click.option("--routing-imbalance", type=click.FloatRange(min=1.0), default=1.0, show_default=True,
                        help="Mixture-of-Experts models: the token rows the busiest expert-parallel rank gets over the "
                             "average (1: balanced routing); prices that rank's expert products, kept tensors and "
                             "all-to-alls")(func)
    func = click.option("--seq-len", type=click.IntRange(min=1), default=None,
                        help="sequence length (default: the model's)")(func)
    func = click.option("--device", "device", default="h100-80gb", show_default=True,
                        help="device profile: a name in profiles/ or a path to a profile JSON")(func)
    func = click.option("--gpus-per-node", type=click.IntRange(1, MAX_DEVICES_PER_NODE), default=8,
                        show_default=True)(func)
    return func
