"""Contexts left out before their chains are built (branch and bound), with the same frontier.

A context (the global choices: mesh, micro-batch, virtual stages, ZeRO, ...) prices every point of its stage's
Pareto set. Most contexts put none of them on the frontier (on GPT-3 175B over 1024 GPUs ~90% of them), yet
their chains are composed and their points priced. Here each context is first priced four times, in one call
(its two real plans, its ideal point, and the most compute its plans have):

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
- for a model of one block, the contexts that bound leaves are priced again at the corners of the lower convex
  hull of their one-strategy (time, activations) points (``_corners``), each at or above the ideal point and
  together still below every mix of strategies (~85% dropped).

A context whose bound is strictly dominated by one of the real plans has only dominated plans: it is dropped.
The frontier is the one the full search finds (tests/test_search.py checks it against the search without bounds
and against exhaustive enumeration).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.context import ContextTable
from ..cost.layer import BlockCost
from ..cost.model import ModelCost, evaluate_rows
from ..space.plan import LayerStrategy
from .pareto import front_by_time


@dataclass(frozen=True)
class Seeds:
    """The real plans priced to bound the contexts (candidates of the search), each running one strategy per block
    on all its copies: per plan its priced (time, memory), its context (a row of the search's ``ContextTable``), its
    tp, and per block the strategy (an index into the block's options at that tp) and the copies."""

    values: np.ndarray                     # (n, 2): iteration time, peak memory
    rows: np.ndarray                       # (n,)
    tp: np.ndarray                         # (n,)
    picks: np.ndarray                      # (n, blocks)
    copies: np.ndarray                     # (n, blocks)

    @staticmethod
    def empty(blocks: int) -> Seeds:
        return Seeds(np.zeros((0, 2)), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                     np.zeros((0, blocks), dtype=np.int64), np.zeros((0, blocks), dtype=np.int64))

    def strategies(self, s: int, options: dict) -> tuple[np.ndarray, list[list[LayerStrategy]]]:
        """Plan ``s``'s copies per strategy (the blocks' option lists side by side) and those option lists."""
        lists = [options[(b, int(self.tp[s]))] for b in range(self.picks.shape[1])]
        counts = [np.zeros(len(opts), dtype=np.int64) for opts in lists]
        for b, c in enumerate(counts):
            c[self.picks[s, b]] = self.copies[s, b]
        return (np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)), lists


def bound_contexts(model: ModelCost, table: ContextTable, grouped: list[tuple], options: dict
                   ) -> tuple[list[tuple], Seeds]:
    """``grouped`` (tp, branches, micro-batch, cp, ep, layout, rows of ``table``) without the contexts no frontier
    point can come from, and the real plans priced to show it (candidates of the search)."""
    if not grouped:
        return grouped, Seeds.empty(len(model.blocks))
    sums, picks, copies = _entry_rows(model, grouped, options)  # per entry: fast, lean, most compute, bound corners
    per_entry = np.array([len(rows) for *_, rows in grouped])
    entry = np.repeat(np.arange(len(grouped)), per_entry)
    ctxs = np.concatenate([rows for *_, rows in grouped])
    # the ideal point first (4 rows a context: fastest, leanest, most compute, ideal), then the corners of the
    # contexts it leaves (most are dropped by their ideal point, which every corner is at or above)
    t, back, acts, transient, params = sums[entry, :4].reshape(-1, 5).T
    r = evaluate_rows(model, table, np.repeat(ctxs, 4), t, back, acts, transient, params, totals_only=True)
    time_s, memory, exposed = (r[k].reshape(-1, 4) for k in
                               ("iteration_time_s", "peak_memory_bytes", "data_parallel_exposed_s"))
    real = np.stack([time_s[:, :2].ravel(), memory[:, :2].ravel()], axis=1)
    dropped = _dominated(real, time_s[:, 3] - exposed[:, 3] + exposed[:, 2], memory[:, 3])
    rest, corners = np.flatnonzero(~dropped), sums.shape[1] - 4
    if corners and len(rest):
        t, back, acts, transient, params = sums[entry[rest], 4:].reshape(-1, 5).T
        c = evaluate_rows(model, table, np.repeat(ctxs[rest], corners), t, back, acts, transient, params,
                          totals_only=True)
        low_time = (c["iteration_time_s"] - c["data_parallel_exposed_s"]).reshape(-1, corners) + exposed[rest, 2:3]
        dropped[rest] = _dominated(real, low_time.ravel(), c["peak_memory_bytes"]).reshape(-1, corners).all(axis=1)
    kept, start = [], 0
    for (tp, branches, mb, cp, ep, layout, rows), n in zip(grouped, per_entry):
        mine = rows[~dropped[start:start + n]]
        start += n
        if len(mine):
            kept.append((tp, branches, mb, cp, ep, layout, mine))
    tps = np.array([tp for tp, *_ in grouped], dtype=np.int64)
    seeds = np.repeat(entry, 2)                    # per context: its fastest plan, then its leanest
    return kept, Seeds(real, np.repeat(ctxs, 2), tps[seeds], picks[seeds, :, np.tile([0, 1], len(entry))],
                       copies[seeds])


def _entry_rows(model: ModelCost, grouped: list[tuple], options: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per entry of ``grouped``: sums as ``device_chain_sums`` gives them (time, backward, activations, transient,
    parameters) of its fastest and leanest one-strategy plans, of the most compute with the least parameters, of its
    ideal point (each least), and of its bound's corners (``_corners``; a model of one block), entries x (4 +
    corners) x 5; and per entry and block, the strategy the fastest and the leanest plan run on every copy
    (entries x blocks x 2) and the copies (entries x blocks). Computed for all entries at once, block by block."""
    hull = len(model.blocks) == 1           # the hull's corners for one block; several blocks: the ideal point only
    keys: dict[tuple, int] = {}     # entries sharing (tp, branches, micro-batch, cp, ep) share their layer table
    key_of = np.array([keys.setdefault((tp, branches, mb, cp, ep), len(keys))
                       for tp, branches, mb, cp, ep, _, _ in grouped])
    layouts = np.array([lay for *_, lay, _ in grouped], dtype=np.int64)      # entries x blocks x (chains, groups, size)
    at = np.arange(len(grouped))
    rows = None
    picks = np.zeros((len(grouped), len(model.blocks), 2), dtype=np.int64)
    all_copies = np.zeros((len(grouped), len(model.blocks)), dtype=np.int64)
    for b in range(len(model.blocks)):
        layers = [_layer_table(model.blocks[b][1], options[(b, tp)], tp, branches, mb, cp, ep)
                  for tp, branches, mb, cp, ep in keys]
        width = max(len(values) for values, _ in layers)
        per_key = np.full((len(keys), width, 6), np.inf)          # time, backward, acts, transient, params, change
        per_key[..., 1:] = 0.0
        split_key = np.zeros((len(keys), width), dtype=bool)
        for k, (values, sp) in enumerate(layers):
            per_key[k, :len(values)], split_key[k, :len(sp)] = values, sp
        table, split = per_key[key_of], split_key[key_of]
        chains, copies = layouts[:, b, 0], layouts[:, b].prod(axis=1)
        # one strategy on every copy: each of the device's chains pays two layout changes if it splits the stream
        sums = np.stack([copies[:, None] * table[..., 0] + np.where(split, 2 * chains[:, None] * table[..., 5], 0.0),
                         copies[:, None] * table[..., 1], copies[:, None] * table[..., 2], table[..., 3],
                         copies[:, None] * table[..., 4]], axis=-1)
        sums[np.isinf(table[..., 0])] = np.inf
        least = [sums[..., k].min(axis=1) for k in (2, 3, 4)]
        if hull:                        # per key its corners' (fast end, lean end) strategies, padded by repeats
            pairs = [_corners(values[:, 0], values[:, 2]) for values, _ in layers]
            width_c = max(len(p) for p in pairs)
            pairs = np.array([p + [p[0]] * (width_c - len(p)) for p in pairs], dtype=np.int64)[key_of]
            low = np.stack(np.broadcast_arrays(
                copies[:, None] * table[at[:, None], pairs[..., 0], 0], np.zeros((len(grouped), 1)),
                copies[:, None] * table[at[:, None], pairs[..., 1], 2], least[1][:, None], least[2][:, None]), axis=-1)
        else:
            low = np.zeros((len(grouped), 0, 5))
        ideal = np.stack([copies * table[..., 0].min(axis=1), np.zeros(len(grouped)), *least], axis=1)
        # the most compute any plan has to hide communication behind: the longest forward (what the stage runs
        # besides its backward, layout changes included) and the longest backward, each over the strategies
        forward = np.where(np.isinf(table[..., 0]), -np.inf, table[..., 0] - table[..., 1]).max(axis=1)
        backward = np.where(np.isinf(table[..., 0]), -np.inf, table[..., 1]).max(axis=1)
        changes = np.where(split.any(axis=1), 2 * chains * table[:, 0, 5], 0.0)
        high = np.stack([copies * (forward + backward) + changes, copies * backward, *least], axis=1)
        fast = _argbest(sums[..., 0], sums[..., 2])
        lean = _argbest(sums[..., 2], sums[..., 0])
        parts = np.concatenate([sums[at, fast][:, None], sums[at, lean][:, None], high[:, None], ideal[:, None], low],
                               axis=1)
        if rows is None:
            rows = parts
        else:
            rows[..., [0, 1, 2, 4]] += parts[..., [0, 1, 2, 4]]
            rows[..., 3] = np.maximum(rows[..., 3], parts[..., 3])
        picks[:, b, 0], picks[:, b, 1], all_copies[:, b] = fast, lean, copies
    return rows, picks, all_copies


def _corners(time_s: np.ndarray, activations: np.ndarray) -> list[tuple[int, int]]:
    """The corners of a lower bound of every mix of strategies, as (i, j): the time of strategy i's copies with the
    activations of strategy j's. A mix of strategies over k copies sums (time, activations) = k x a convex
    combination of the one-strategy points, so it lies in their convex hull, on or above the hull's lower-left
    boundary: a chain of vertices from the fastest to the leanest, activations falling. A mix between vertices i and
    j (the next) has at least i's time and j's activations. So the corners (i, j) of consecutive vertices bound every
    mix; with two vertices, the one corner is the ideal point (fastest time, least activations)."""
    order = sorted((i for i in range(len(time_s)) if np.isfinite(time_s[i])), key=lambda i: (time_s[i], activations[i]))
    chain: list[int] = []
    for i in order:
        if chain and activations[i] >= activations[chain[-1]]:
            continue                        # no leaner than a faster one: inside the hull
        while len(chain) >= 2 and _turn(chain[-2], chain[-1], i, time_s, activations) <= 0:
            chain.pop()                     # above the segment that skips it
        chain.append(i)
    return list(zip(chain, chain[1:])) or [(chain[0], chain[0])]


def _turn(o: int, a: int, b: int, x: np.ndarray, y: np.ndarray) -> float:
    """> 0 where o -> a -> b turns counter-clockwise (a lies below the segment o -> b, for x increasing)."""
    return (x[a] - x[o]) * (y[b] - y[o]) - (y[a] - y[o]) * (x[b] - x[o])


def _layer_table(cost: BlockCost, opts: list[LayerStrategy], tp: int, branches: tuple[str, ...], mb: int, cp: int = 1,
                 ep: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per strategy: (time, backward, activations, transient, parameters, layout change) of one copy, and whether
    it splits the stream."""
    change = cost.layout_change_s(tp, mb)
    layers = [cost.layer(o, tp, branches, mb, cp, ep) for o in opts]
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
