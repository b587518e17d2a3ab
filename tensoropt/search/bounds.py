"""Contexts left out before their chains are built (branch and bound), with the same frontier.

A context (the global choices: mesh, micro-batch, virtual stages, ZeRO, ...) prices every point of its stage's
Pareto set. Most contexts put none of them on the frontier (on GPT-3 175B over 1024 GPUs ~90% of them), yet
their chains are composed and their points priced. Here each context is first priced three times, in one call:

- two real plans, every copy running one strategy: the fastest one (least layer time, layout changes included)
  and the leanest one (least kept activations). They are points of the context's space, priced as ``estimate``
  prices them, and they join the candidates (so the frontier holds them, or points that dominate them);
- a bound: the least layer time, backward time, kept activations, transient and parameters any of its plans
  can have (each over the strategies on its own, so no plan reaches below it). Its time is the pipeline's and the
  optimizer's at those least sums, plus the data-parallel communication left exposed (``data_parallel_exposed_s``,
  the one term that more compute lowers) priced at the most compute any plan has to hide it behind (the longest
  forward and the longest backward over the strategies, every layout change paid) and the fewest parameters:
  exposed communication is non-increasing in the forward and backward it hides behind and non-decreasing in the
  bytes moved (``cost.data_parallel``: maxima of differences, FSDP2's per-unit sums, a non-negative overlap
  share). Time is non-decreasing in the layer time and parameters, and memory in the activations, transient and
  parameters (``cost.model.evaluate_rows``, ``cost.memory.memory_rows``: sums and maxima of them with
  non-negative factors), so every plan of the context is at or above its bound in both. (Pricing the exposed part
  at zero instead dropped ~72% of the contexts of GPT-3 175B on 1024 GPUs; this ~84%.)

A context whose bound is strictly dominated by one of the real plans has only dominated plans: it is dropped.
The frontier is the one the full search finds (tests/test_search.py checks it against the search without bounds
and against exhaustive enumeration).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.layer import BlockCost
from ..cost.model import Context, ModelCost, evaluate_rows
from ..space.plan import LayerStrategy
from .pareto import front_by_time


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
    if not grouped:
        return grouped, Seeds(np.zeros((0, 2)), [], [], [])
    rows, counts = _entry_rows(model, grouped, options)           # per entry: 3 rows of sums; 2 plans' counts
    per_entry = np.array([len(priced) for *_, priced in grouped])
    entry = np.repeat(np.arange(len(grouped)), per_entry)
    ctxs = [c for *_, priced in grouped for c in priced]
    t, back, acts, transient, params = rows[entry].reshape(-1, 5).T
    r = evaluate_rows(model, ctxs, np.repeat(np.arange(len(ctxs)), 4), t, back, acts, transient, params,
                      totals_only=True)
    time_s = r["iteration_time_s"].reshape(-1, 4)
    memory = r["peak_memory_bytes"].reshape(-1, 4)
    exposed = r["data_parallel_exposed_s"].reshape(-1, 4)
    low_time = time_s[:, 0] - exposed[:, 0] + exposed[:, 3]
    real = np.stack([time_s[:, 1:3].ravel(), memory[:, 1:3].ravel()], axis=1)
    dropped = _dominated(real, low_time, memory[:, 0])
    kept, start = [], 0
    for (tp, branches, mb, layout, priced), n in zip(grouped, per_entry):
        mine = [c for c, drop in zip(priced, dropped[start:start + n]) if not drop]
        start += n
        if mine:
            kept.append((tp, branches, mb, layout, mine))
    lists = [[options[(b, tp)] for b in range(len(model.blocks))] for tp, *_ in grouped]
    return kept, Seeds(real, [c for c in ctxs for _ in range(2)], [counts[e][k] for e in entry for k in (0, 1)],
                       [lists[e] for e in entry for _ in range(2)])


def _entry_rows(model: ModelCost, grouped: list[tuple], options: dict) -> tuple[np.ndarray, list]:
    """Per entry of ``grouped``: (4, 5) sums (bound, fastest plan, leanest plan, the most compute with the bound's
    parameters) as ``device_chain_sums`` gives them (time, backward, activations, transient, parameters), and the
    two plans' counts (the blocks' option lists
    side by side). Computed for all entries at once, block by block."""
    rows = np.zeros((len(grouped), 4, 5))
    counts: list[list[list[np.ndarray]]] = [[[], []] for _ in grouped]
    for b in range(len(model.blocks)):
        layers = {}
        for tp, branches, mb, _, _ in grouped:
            if (tp, branches, mb) not in layers:
                layers[(tp, branches, mb)] = _layer_table(model.blocks[b][1], options[(b, tp)], tp, branches, mb)
        width = max(len(table[0]) for table in layers.values())
        table = np.full((len(grouped), width, 6), np.inf)          # time, backward, acts, transient, params, change
        table[..., 1:] = 0.0
        split = np.zeros((len(grouped), width), dtype=bool)
        for e, (tp, branches, mb, _, _) in enumerate(grouped):
            values, sp = layers[(tp, branches, mb)]
            table[e, :len(values)], split[e, :len(sp)] = values, sp
        chains, copies = np.array([[lay[b][0], lay[b][0] * lay[b][1] * lay[b][2]] for *_, lay, _ in grouped]).T
        # one strategy on every copy: each of the device's chains pays two layout changes if it splits the stream
        sums = np.stack([copies[:, None] * table[..., 0] + np.where(split, 2 * chains[:, None] * table[..., 5], 0.0),
                         copies[:, None] * table[..., 1], copies[:, None] * table[..., 2], table[..., 3],
                         copies[:, None] * table[..., 4]], axis=-1)
        sums[np.isinf(table[..., 0])] = np.inf
        low = np.stack([copies * table[..., 0].min(axis=1), np.zeros(len(grouped)), sums[..., 2].min(axis=1),
                        sums[..., 3].min(axis=1), sums[..., 4].min(axis=1)], axis=1)
        # the most compute any plan has to hide communication behind: the longest forward (what the stage runs
        # besides its backward, layout changes included) and the longest backward, each over the strategies
        forward = np.where(np.isinf(table[..., 0]), -np.inf, table[..., 0] - table[..., 1]).max(axis=1)
        backward = np.where(np.isinf(table[..., 0]), -np.inf, table[..., 1]).max(axis=1)
        changes = np.where(split.any(axis=1), 2 * chains * table[:, 0, 5], 0.0)
        high = np.stack([copies * (forward + backward) + changes, copies * backward, low[:, 2], low[:, 3], low[:, 4]],
                        axis=1)
        fast = _argbest(sums[..., 0], sums[..., 2])
        lean = _argbest(sums[..., 2], sums[..., 0])
        at = np.arange(len(grouped))
        for k, (part, pick) in enumerate(((low, None), (sums[at, fast], fast), (sums[at, lean], lean), (high, None))):
            rows[:, k, [0, 1, 2, 4]] += part[:, [0, 1, 2, 4]]
            rows[:, k, 3] = np.maximum(rows[:, k, 3], part[:, 3])
            if pick is not None:
                chosen = np.zeros((len(grouped), width), dtype=np.int64)
                chosen[at, pick] = copies
                for e, (tp, *_) in enumerate(grouped):
                    counts[e][k - 1].append(chosen[e, :len(options[(b, tp)])])
    return rows, [[np.concatenate(c) if c else np.zeros(0, np.int64) for c in pair] for pair in counts]


def _layer_table(cost: BlockCost, opts: list[LayerStrategy], tp: int, branches: tuple[str, ...], mb: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per strategy: (time, backward, activations, transient, parameters, layout change) of one copy, and whether
    it splits the stream."""
    change = cost.layout_change_s(tp, mb)
    layers = [cost.layer(o, tp, branches, mb) for o in opts]
    return (np.array([[c.time_s, c.backward_s, c.activation_bytes, c.transient_bytes, c.parameters, change]
                      for c in layers]), np.array([o.sequence_parallel and tp > 1 for o in opts]))


def _argbest(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Per row, the column least in ``first``, ties broken by ``second`` (then the first such column)."""
    best = first.min(axis=1, keepdims=True)
    second = np.where(first == best, second, np.inf)
    return np.argmin(second, axis=1)


def _dominated(real: np.ndarray, low_time: np.ndarray, low_memory: np.ndarray) -> np.ndarray:
    """Per bound, whether a real point is no worse in both and better in one (so it beats every plan above it)."""
    front = front_by_time(real)
    times, memories = real[front, 0], real[front, 1]             # time ascending, memory descending
    at = np.searchsorted(times, low_time, side="right") - 1      # the leanest front point no slower than the bound
    found = at >= 0
    at = np.maximum(at, 0)
    return found & (memories[at] <= low_memory) & ((times[at] < low_time) | (memories[at] < low_memory))


__all__ = ["Seeds", "bound_contexts"]
