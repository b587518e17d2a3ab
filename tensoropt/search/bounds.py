"""Contexts left out before their chains are built (branch and bound), with the same frontier.

A context (the global choices: mesh, micro-batch, virtual stages, ZeRO, ...) prices every point of its stage's
Pareto set. Most contexts put none of them on the frontier (on GPT-3 175B over 1024 GPUs ~90% of them), yet
their chains are composed and their points priced. Here each context is first priced three times, in one call:

- two real plans, every copy running one strategy: the fastest one (least layer time, layout changes included)
  and the leanest one (least kept activations). They are points of the context's space, priced as ``estimate``
  prices them, and they join the candidates (so the frontier holds them, or points that dominate them);
- a bound: the least layer time, backward time, kept activations, transient and parameters any of its plans
  can have (each over the strategies on its own, so no plan reaches below it), priced with the data-parallel
  communication that compute may hide left out (``data_parallel_exposed_s``: >= 0, the one term of the time that
  more compute can lower). Time is then non-decreasing in the layer time and parameters, and memory in the
  activations, transient and parameters (``cost.model.evaluate_rows``, ``cost.memory.memory_rows``: sums and
  maxima of them with non-negative factors), so every plan of the context is at or above its bound in both.

A context whose bound is strictly dominated by one of the real plans has only dominated plans: it is dropped.
The frontier is the one the full search finds (tests/test_search.py checks it against the search without bounds
and against exhaustive enumeration).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.model import Context, ModelCost, evaluate_rows
from ..space.plan import LayerStrategy
from .pareto import nondominated


@dataclass(frozen=True)
class Seeds:
    """The real plans priced to bound the contexts: per row its priced (time, memory), context and counts."""

    values: np.ndarray                     # (n, 2): iteration time, peak memory
    contexts: list[Context]
    counts: list[np.ndarray]               # per row: copies per strategy, the blocks' option lists side by side
    option_lists: list[list[list[LayerStrategy]]]


def bound_contexts(model: ModelCost, grouped: list[tuple], options: dict) -> tuple[list[tuple], Seeds]:
    """``grouped`` (tp, branches, micro-batch, layout, contexts) without the contexts no frontier point can come
    from, and the real plans priced to show it (candidates of the search)."""
    blocks = range(len(model.blocks))
    rows, ctxs, which, seeds_counts, seeds_lists = [], [], [], [], []
    for tp, branches, mb, layout, priced in grouped:
        bound, fast, lean = _entry_rows(model, blocks, options, tp, branches, mb, layout)
        lists = [options[(b, tp)] for b in blocks]
        for ctx in priced:
            rows += [bound, fast[0], lean[0]]
            which += [len(ctxs)] * 3
            ctxs.append(ctx)
            seeds_counts += [fast[1], lean[1]]
            seeds_lists += [lists, lists]
    if not ctxs:
        return grouped, Seeds(np.zeros((0, 2)), [], [], [])
    t, back, acts, transient, params = np.array(rows, dtype=float).T
    r = evaluate_rows(model, ctxs, np.array(which), t, back, acts, transient, params)
    time_s = r["iteration_time_s"].reshape(-1, 3)
    memory = r["peak_memory_bytes"].reshape(-1, 3)
    low_time = time_s[:, 0] - r["data_parallel_exposed_s"].reshape(-1, 3)[:, 0]
    real = np.stack([time_s[:, 1:].ravel(), memory[:, 1:].ravel()], axis=1)
    out = _dominated(real, low_time, memory[:, 0])
    kept, start = [], 0
    for tp, branches, mb, layout, priced in grouped:
        mine = [c for c, drop in zip(priced, out[start:start + len(priced)]) if not drop]
        start += len(priced)
        if mine:
            kept.append((tp, branches, mb, layout, mine))
    return kept, Seeds(real, [c for c in ctxs for _ in range(2)], seeds_counts, seeds_lists)


def _entry_rows(model: ModelCost, blocks: range, options: dict, tp: int, branches: tuple[str, ...], mb: int,
                layout: tuple) -> tuple[list[float], tuple[list[float], np.ndarray], tuple[list[float], np.ndarray]]:
    """(bound, (fastest plan's sums, counts), (leanest plan's sums, counts)) of one (tp, branches, micro-batch,
    chain split): sums as ``device_chain_sums`` gives them (time, backward, activations, transient, parameters)."""
    bound = np.zeros(5)
    fast, lean = np.zeros(5), np.zeros(5)
    fast_counts, lean_counts = [], []
    for b, (chains, groups, size) in zip(blocks, layout):
        cost, opts = model.blocks[b][1], options[(b, tp)]
        copies = chains * groups * size
        layers = [cost.layer(o, tp, branches, mb) for o in opts]
        change = cost.layout_change_s(tp, mb)
        # one strategy on every copy: each of the device's chains pays two layout changes if it splits the stream
        sums = np.array([[copies * c.time_s + (2 * chains * change if o.sequence_parallel and tp > 1 else 0.0),
                          copies * c.backward_s, copies * c.activation_bytes, c.transient_bytes,
                          copies * c.parameters] for o, c in zip(opts, layers)])
        low = sums.min(axis=0)
        low[0] = copies * min(c.time_s for c in layers)
        bound += np.array([low[0], 0.0, low[2], 0.0, low[4]])
        bound[3] = max(bound[3], low[3])
        for total, counts, i in ((fast, fast_counts, np.lexsort((sums[:, 2], sums[:, 0]))[0]),
                                 (lean, lean_counts, np.lexsort((sums[:, 0], sums[:, 2]))[0])):
            total[[0, 1, 2, 4]] += sums[i, [0, 1, 2, 4]]
            total[3] = max(total[3], sums[i, 3])
            counts.append(np.eye(len(opts), dtype=np.int64)[i] * copies)
    return (bound.tolist(), (fast.tolist(), np.concatenate(fast_counts) if fast_counts else np.zeros(0, np.int64)),
            (lean.tolist(), np.concatenate(lean_counts) if lean_counts else np.zeros(0, np.int64)))


def _dominated(real: np.ndarray, low_time: np.ndarray, low_memory: np.ndarray) -> np.ndarray:
    """Per bound, whether a real point is no worse in both and better in one (so it beats every plan above it)."""
    front = nondominated(np.concatenate([real, np.zeros((len(real), 1))], axis=1))
    front = front[np.argsort(real[front, 0], kind="stable")]
    times, memories = real[front, 0], real[front, 1]             # time ascending, memory descending
    at = np.searchsorted(times, low_time, side="right") - 1      # the leanest front point no slower than the bound
    found = at >= 0
    at = np.maximum(at, 0)
    return found & (memories[at] <= low_memory) & ((times[at] < low_time) | (memories[at] < low_memory))


__all__ = ["Seeds", "bound_contexts"]
