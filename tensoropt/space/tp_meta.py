"""The tensor-parallel checks recorded in a captured graph's metadata (``space.tp_check`` makes them at capture time,
with the model at hand): read by the planner, which plans a graph without importing torch."""

from __future__ import annotations

import json
from dataclasses import replace

from ..graph.ir import OpGraph

TP_CHECKS_META = "tp_checks"     # graph metadata: {block: {branch: {"max_tp": m} | {"refused": why}}}


def with_tp_checks(graph: OpGraph, checks: dict) -> OpGraph:
    """``graph`` with the checks recorded in its metadata."""
    meta = dict(graph.metadata) | {TP_CHECKS_META: json.dumps(checks, sort_keys=True)}
    return replace(graph, metadata=tuple(sorted(meta.items())))


def tp_checks(graph: OpGraph, block: str) -> dict | None:
    """The recorded checks of ``block``'s branches; None for a graph captured without them (planned as analysed)."""
    text = graph.meta(TP_CHECKS_META)
    return json.loads(text).get(block, {}) if text else None


__all__ = ["TP_CHECKS_META", "tp_checks", "with_tp_checks"]
