"""The frontier artifact: points (plan, time, memory), queries on it, JSON and a plot."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TensorOptError
from ..paths import atomic_output
from ..search.ft import FrontierPoint
from ..space.plan import Plan

FRONTIER_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Frontier:
    model: str
    devices: tuple[int, ...]
    devices_per_node: int
    device_profile: str
    global_batch: int
    seq_len: int | None
    flops_per_sample: float            # forward + backward FLOPs of one sample (no recomputation)
    peak_flops_per_device: float
    points: tuple[FrontierPoint, ...]  # sorted by time, mutually non-dominated
    search_seconds: float = 0.0
    capture_seconds: float = 0.0
    folding: dict = field(default_factory=dict)
    engines: tuple[str, ...] = ()      # the engine that runs each point ("" for none: ``plan(..., engines=None)``)

    def engine_of(self, p: FrontierPoint) -> str | None:
        """The engine that runs ``p``: "" for a plan no engine runs (the planner's whole space), None where the
        frontier does not say (a file saved before points named their engine)."""
        return next((e for q, e in zip(self.points, self.engines) if q is p), None)

    def tokens_per_s(self, p: FrontierPoint) -> float | None:
        return self.global_batch * self.seq_len / p.iteration_time_s if self.seq_len else None

    def mfu(self, p: FrontierPoint) -> float:
        """Model FLOPs utilisation (Chowdhery et al. 2022): model FLOPs, recomputation excluded."""
        return self.flops_per_sample * self.global_batch / (p.iteration_time_s * p.plan.devices
                                                              * self.peak_flops_per_device)

    def fastest_within(self, memory_bytes: float) -> FrontierPoint | None:
        fits = [p for p in self.points if p.peak_memory_bytes <= memory_bytes]
        return min(fits, key=lambda p: p.iteration_time_s) if fits else None

    @property
    def least_memory_bytes(self) -> float:
        return min(p.peak_memory_bytes for p in self.points)

    def point_json(self, p: FrontierPoint) -> dict[str, Any]:
        engine = self.engine_of(p)
        return {"iteration_time_s": p.iteration_time_s, "peak_memory_bytes": int(p.peak_memory_bytes),
                "devices": p.plan.devices, "tokens_per_s": self.tokens_per_s(p), "mfu": self.mfu(p),
                "plan": p.plan.to_json()} | ({"engine": engine} if engine else {})

    def to_json(self, chosen: FrontierPoint | None = None) -> dict[str, Any]:
        return {
            "schema_version": FRONTIER_SCHEMA_VERSION, "kind": "tensoropt.frontier",
            "model": self.model, "devices": list(self.devices), "devices_per_node": self.devices_per_node,
            "device_profile": self.device_profile, "global_batch": self.global_batch, "seq_len": self.seq_len,
            "flops_per_sample": self.flops_per_sample, "peak_flops_per_device": self.peak_flops_per_device,
            "search_seconds": self.search_seconds, "capture_seconds": self.capture_seconds,
            "folding": self.folding,
            "points": [self.point_json(p) for p in self.points],
            "chosen": self.point_json(chosen) if chosen is not None else None,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Frontier:
        if d.get("kind") != "tensoropt.frontier" or d.get("schema_version") != FRONTIER_SCHEMA_VERSION:
            raise ValueError(f"not a tensoropt frontier of schema_version {FRONTIER_SCHEMA_VERSION}")
        points = tuple(FrontierPoint(Plan.from_json(p["plan"]), float(p["iteration_time_s"]),
                                     float(p["peak_memory_bytes"])) for p in d["points"])
        if not points:
            raise ValueError("the frontier has no points")
        return Frontier(d["model"], tuple(d["devices"]), int(d["devices_per_node"]), d["device_profile"],
                        int(d["global_batch"]), d.get("seq_len"), float(d["flops_per_sample"]),
                        float(d["peak_flops_per_device"]), points, float(d.get("search_seconds", 0.0)),
                        float(d.get("capture_seconds", 0.0)), d.get("folding", {}),
                        tuple(p["engine"] for p in d["points"]) if all("engine" in p for p in d["points"]) else ())


def load_frontier(path: str | Path) -> Frontier:
    try:
        return Frontier.from_json(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError) as exc:
        raise TensorOptError(f"{path}: not a readable frontier file ({exc}); save one with "
                             "`tensoropt frontier ... --out FILE.json`") from exc


def plot_frontier(frontier: Frontier, path: str | Path, chosen: FrontierPoint | None = None) -> None:
    """Peak memory against iteration time, one colour per device count, the chosen point marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for n in sorted({p.plan.devices for p in frontier.points}):
        pts = [p for p in frontier.points if p.plan.devices == n]
        ax.plot([p.peak_memory_bytes / 2**30 for p in pts], [p.iteration_time_s for p in pts], "o-", ms=3,
                label=f"{n} devices")
    if chosen is not None:
        ax.plot([chosen.peak_memory_bytes / 2**30], [chosen.iteration_time_s], "*", ms=16, color="crimson",
                label=f"chosen: {chosen.plan.summary()[:48]}")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"{frontier.model} on {frontier.device_profile}, global batch {frontier.global_batch}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_output(path) as tmp:           # never a half-drawn file at ``path``
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".").lower() or "png")
    plt.close(fig)
