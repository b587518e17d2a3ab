"""The bf16-weights graph a bf16-mixed capture carries in its metadata (``graph.precision`` captures it, with torch):
read by the planner without importing torch."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

from .ir import OpGraph

BF16_WEIGHTS_META = "bf16_weights_graph"     # graph metadata: the model captured with bf16 weights (JSON)


def with_bf16_weights(graph: OpGraph, bf16_weights: OpGraph) -> OpGraph:
    """``graph`` (bf16-mixed: float32 weights under a bf16 autocast) carrying ``bf16_weights``, the same model
    captured with its weights cast to bf16 under the same autocast, as FSDP2 and DeepSpeed run it. Kept in the
    metadata so that the graph cache, the launcher and every caller that passes a graph keep both."""
    meta = dict(graph.metadata) | {BF16_WEIGHTS_META: json.dumps(bf16_weights.to_json())}
    return replace(graph, metadata=tuple(sorted(meta.items())))


def bf16_weights_graph(graph: OpGraph) -> OpGraph | None:
    """The graph ``with_bf16_weights`` attached, None for a graph captured without one."""
    text = graph.meta(BF16_WEIGHTS_META)
    return _parsed(text) if text else None


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> OpGraph:
    return OpGraph.from_json(json.loads(text))


__all__ = ["BF16_WEIGHTS_META", "bf16_weights_graph", "with_bf16_weights"]
