"""Expert parallelism (``Plan.ep``): which degrees a Mixture-of-Experts model can run, and what one block's experts
are to the cost model.

The capture records every experts module (``graph.experts``: its experts, top-k and weights). ``ep`` ranks taken
from data parallelism each hold experts / ep of every such module; tokens go to their experts' ranks and back by
all-to-all (``runtime.parallel.expert_parallel``). A degree runs when it divides every layer's experts and the
data-parallel degree, in the torch engine with pp 1, no context parallelism, no offload, eager kernels
(``search.engines.unsupported``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..graph.bf16_meta import bf16_weights_graph, with_bf16_weights
from ..graph.ir import EXPERTS_META, Op, OpGraph

# graph metadata: how many times the average token rows the busiest expert-parallel rank gets (>= 1; 1: balanced
# routing, what the capture prices), set by the planning commands' --routing-imbalance
ROUTING_IMBALANCE_META = "routing_imbalance"


def with_routing_imbalance(graph: OpGraph, factor: float) -> OpGraph:
    """``graph`` priced with its busiest expert-parallel rank getting ``factor`` x the average token rows (the graph
    it carries with bf16 weights too, which prices the engines that compute with them: ``search.engines``);
    ``graph`` itself at 1, balanced routing, what the capture prices."""
    if factor < 1:
        raise ValueError(f"--routing-imbalance {factor}: the busiest rank gets at least the average rows: give >= 1")
    if factor == 1:
        return graph
    meta = dict(graph.metadata) | {ROUTING_IMBALANCE_META: repr(float(factor))}
    out = replace(graph, metadata=tuple(sorted(meta.items())))
    bf16 = bf16_weights_graph(graph)
    return with_bf16_weights(out, with_routing_imbalance(bf16, factor)) if bf16 is not None else out


@dataclass(frozen=True)
class Experts:
    """The experts of a graph: per experts module its experts and top-k, and every expert weight's name."""

    modules: tuple[tuple[str, int, int], ...]      # (module path, experts, top-k)
    params: frozenset[str]
    imbalance: float = 1.0        # the busiest ep rank's token rows over the average (``ROUTING_IMBALANCE_META``)

    @staticmethod
    def of(graph: OpGraph) -> Experts:
        raw = json.loads(graph.meta(EXPERTS_META) or "{}")
        return Experts(tuple((path, int(m["experts"]), int(m["top_k"])) for path, m in sorted(raw.items())),
                       frozenset(p for m in raw.values() for p in m["params"]),
                       float(graph.meta(ROUTING_IMBALANCE_META) or 1.0))

    @property
    def counts(self) -> tuple[int, ...]:
        """The experts of each experts module."""
        return tuple(sorted({e for _, e, _ in self.modules}))

    def refusal(self, ep: int) -> str:
        """Why the model cannot shard its experts over ``ep`` ranks, in one line naming what to change; "" when it
        can."""
        if ep <= 1:
            return ""
        if not self.modules:
            return (f"--ep {ep} shards the experts of Mixture-of-Experts layers, and this model has none (no module "
                    "holds per-expert weight stacks): leave --ep out")
        if bad := [e for e in self.counts if e % ep]:
            return (f"expert parallelism over {ep} ranks needs every layer's experts split evenly, and {bad[0]} "
                    f"experts do not divide by {ep}: pick an --ep dividing {min(self.counts)}")
        return ""

    def degrees(self, dp: int) -> tuple[int, ...]:
        """The degrees > 1 that divide ``dp`` and every layer's experts."""
        if not self.modules:
            return ()
        return tuple(ep for ep in range(2, dp + 1) if dp % ep == 0 and not self.refusal(ep))


def experts_report(graph: OpGraph) -> dict | None:
    """What ``inspect`` shows of a Mixture-of-Experts model (None for a dense one): its experts layers, experts per
    layer, experts per token, the expert weights' elements and the parameters one token computes with (the whole
    model's less, in each layer, the experts it does not visit: (1 - top_k / experts) of the layer's expert
    weights)."""
    raw = json.loads(graph.meta(EXPERTS_META) or "{}")
    if not raw:
        return None
    sizes = dict(graph.params)
    per_layer = {path: sum(sizes[p].numel for p in m["params"] if p in sizes) for path, m in raw.items()}
    idle = sum(n * (1 - raw[path]["top_k"] / raw[path]["experts"]) for path, n in per_layer.items())
    experts = Experts.of(graph)
    return {"layers": len(raw), "experts": list(experts.counts),
            "top_k": sorted({m["top_k"] for m in raw.values()}), "expert_parameters": sum(per_layer.values()),
            "active_parameters": int(graph.num_parameters - idle)}


def expert_ops(ops: tuple[Op, ...], experts: Experts) -> tuple[int, ...]:
    """Indices of a block's ops that read expert weights (its grouped products)."""
    return tuple(i for i, op in enumerate(ops) if any(r.kind == "param" and r.name in experts.params
                                                      for r in op.sources))


def dispatch_bytes(ops: tuple[Op, ...], indices: tuple[int, ...]) -> float:
    """Bytes per sample the dispatch all-to-all moves: the token rows the first expert product reads (tokens x
    top-k rows of the hidden size); the combine moves the last one's output, as large."""
    return float(ops[indices[0]].inputs[0].nbytes) if indices else 0.0


__all__ = ["ROUTING_IMBALANCE_META", "Experts", "dispatch_bytes", "expert_ops", "experts_report",
           "with_routing_imbalance"]
