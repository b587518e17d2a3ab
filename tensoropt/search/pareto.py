"""Pareto sets of partial plans for frontier tracking, held as numpy columns.

A point has a time, an additive memory (activations kept), a max-combined memory (the transient
working set: the largest of the parts, since one layer's backward runs at a time) and, as its
provenance, how many copies use each layer strategy. Combining two sets is the Minkowski sum of
their points (times and kept memory add, transients take the max) followed by dropping dominated
points; all three objectives are minimised. Dominance is exact unless ``eps`` > 0, in which case it
is decided on values rounded up onto a relative grid of ratio (1 + eps), so any dropped point is
within a factor (1 + eps) of a kept one in every objective (epsilon-dominance, Laumanns et al.,
2002). Prunes compose: after d nested prunes a point of the exact frontier is within (1 + eps)^d of
the result; FT nests about 2 log2(copies) + 4 of them.

The search keeps many independent sets at once (one per tensor-parallel branch choice and
micro-batch size): ``ParetoSets`` holds them in one array, rows grouped by set, and every operation
works on all of them in a few numpy calls. Each set comes out exactly as it would alone (same
points, same order), since sorting by set first keeps the order within a set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ParetoSet:
    values: np.ndarray     # (n, 3): time, additive memory, transient memory
    counts: np.ndarray     # (n, S): copies per strategy

    def __len__(self) -> int:
        return len(self.values)

    @staticmethod
    def single(values: np.ndarray, counts: np.ndarray) -> ParetoSet:
        return prune(np.atleast_2d(values).astype(float), np.atleast_2d(counts))


@dataclass(frozen=True)
class ParetoSets:
    """``size`` Pareto sets in one array: rows sorted by ``group`` (the set each belongs to)."""

    values: np.ndarray     # (n, 3)
    counts: np.ndarray     # (n, S)
    group: np.ndarray      # (n,) non-decreasing set index
    size: int

    @staticmethod
    def of(values: np.ndarray, counts: np.ndarray, group: np.ndarray, size: int, eps: float = 0.0) -> ParetoSets:
        """The non-dominated points of each set, from rows in any group order (order within a set kept)."""
        keep = _keep(values, group, eps)
        return ParetoSets(values[keep], counts[keep], group[keep], size)

    def starts(self) -> np.ndarray:
        return np.searchsorted(self.group, np.arange(self.size + 1))

    def lengths(self) -> np.ndarray:
        return np.bincount(self.group, minlength=self.size)

    def set(self, g: int) -> ParetoSet:
        lo, hi = np.searchsorted(self.group, [g, g + 1])
        return ParetoSet(self.values[lo:hi], self.counts[lo:hi])


def nondominated(values: np.ndarray, group: np.ndarray | None = None) -> np.ndarray:
    """Indices of the non-dominated rows of ``values`` (minimisation) within each ``group`` (one group
    if None), duplicates kept once, in (group, time, memory, transient) order.

    Exact: a point is dominated iff a point of its group comes before it in (time, memory) order with
    memory and transient <= its own. Per group the third column's distinct values are ranked (levels);
    for each level, a running minimum of memory over the points at or below it finds the dominated
    ones. Memory is compared through its rank, offset per group so the running minimum restarts at
    each group; all levels of all groups are done in one pass."""
    n = len(values)
    if n <= 1:
        return np.arange(n)
    group = np.zeros(n, dtype=np.int64) if group is None else np.asarray(group, dtype=np.int64)
    idx = np.lexsort((values[:, 2], values[:, 1], values[:, 0], group))
    v, g = values[idx], group[idx]
    same = (v[1:] == v[:-1]) & (g[1:] == g[:-1])[:, None]
    dup = same[:, 0] & same[:, 1] & same[:, 2]               # duplicates are adjacent now
    if dup.any():
        distinct = np.concatenate(([True], ~dup))
        v, g, idx = v[distinct], g[distinct], idx[distinct]
    level = _rank_in_group(v[:, 2], g)
    mem_rank = np.unique(v[:, 1], return_inverse=True)[1].ravel().astype(np.int64)
    key = mem_rank - g * (len(v) + 1)                        # any earlier group's key is larger
    return idx[_undominated_sorted(key, level)]


def _rank_in_group(x: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Dense rank of each value among the distinct values of its group (``group`` non-decreasing)."""
    order = np.lexsort((x, group))
    xs, gs = x[order], group[order]
    new_value = np.concatenate(([True], (xs[1:] != xs[:-1]) | (gs[1:] != gs[:-1])))
    new_group = np.concatenate(([True], gs[1:] != gs[:-1]))
    dense = np.cumsum(new_value) - 1
    rank = np.empty(len(x), dtype=np.int64)
    rank[order] = dense - np.maximum.accumulate(np.where(new_group, dense, 0))
    return rank


def _keep(values: np.ndarray, group: np.ndarray | None, eps: float) -> np.ndarray:
    """Indices to keep. With eps > 0 dominance is decided on values rounded up to a (1 + eps) grid,
    but the kept points keep their exact values (so they still price exactly as ``estimate``)."""
    if eps > 0 and len(values):
        cells = _grid_cells(values, eps)
        packed = None if cells is None else _pack(cells, group)
        if packed is not None:
            return _keep_packed(values, cells, packed, group)
        grid = np.log1p(eps)
        snapped = np.where(values > 0, np.exp(np.ceil(np.log(np.maximum(values, 1e-300)) / grid) * grid), values)
        # among points equal on the grid, the stable pass keeps the first: make it the exactly best
        keys = (values[:, 2], values[:, 1], values[:, 0]) + (() if group is None else (group,))
        order = np.lexsort(keys)
        return order[nondominated(snapped[order], None if group is None else group[order])]
    return nondominated(values, group)


def _grid_cells(values: np.ndarray, eps: float) -> np.ndarray | None:
    """Each value's cell on the (1 + eps) grid as an integer (ceil of its log in steps of log(1 + eps)), in the
    order the rounded-up values have; None where a value is not positive (kept exact by the general path)."""
    if not (values > 0).all():
        return None
    return np.ceil(np.log(values) / np.log1p(eps)).astype(np.int64)


def _pack(cells: np.ndarray, group: np.ndarray | None) -> np.ndarray | None:
    """(group, time cell, memory cell, transient cell) as one int64 that sorts as the tuple; None if it overflows."""
    low = cells.min(axis=0)
    spans = cells.max(axis=0) - low + 1
    groups = 1 if group is None else int(group[-1]) + 1 if len(group) else 1
    if float(groups) * float(np.prod(spans.astype(float))) >= 2.0 ** 62:
        return None
    c = cells - low
    packed = (c[:, 0] * spans[1] + c[:, 1]) * spans[2] + c[:, 2]
    return packed if group is None else packed + np.asarray(group, dtype=np.int64) * int(np.prod(spans))


def _keep_packed(values: np.ndarray, cells: np.ndarray, packed: np.ndarray, group: np.ndarray | None) -> np.ndarray:
    """``_keep`` with eps > 0 on integer cells: one integer sort instead of floating lexsorts. Same answer: per
    cell the exactly best point (time, then memory, then transient) stands for it, and a cell is dropped when
    an earlier one of its group (in (time, memory, transient) cell order) is no larger in memory and transient."""
    order = np.argsort(packed, kind="stable")
    key = packed[order]
    first = np.concatenate(([True], key[1:] != key[:-1]))
    if not first.all():                      # several points in a cell: the exactly best one stands for it
        cell = np.cumsum(first) - 1
        crowded = np.flatnonzero(~first)
        rows = np.sort(np.concatenate([crowded - 1, crowded]))
        rows = rows[np.concatenate(([True], rows[1:] != rows[:-1]))]   # not np.unique: it imports numpy.ma
        pick = rows[np.lexsort((values[order[rows], 2], values[order[rows], 1], values[order[rows], 0], cell[rows]))]
        lead = np.concatenate(([True], cell[pick][1:] != cell[pick][:-1]))
        order[np.flatnonzero(first)[cell[pick[lead]]]] = order[pick[lead]]
        order = order[first]
    g = np.zeros(len(order), dtype=np.int64) if group is None else np.asarray(group, dtype=np.int64)[order]
    mem, transient = cells[order, 1], cells[order, 2]
    level = _rank_in_group(transient, g)
    mem = mem - mem.min()
    mem_key = mem - g * (int(mem.max()) + 1)                      # any earlier group's key is larger
    return order[_undominated_sorted(mem_key, level)]


def _undominated_sorted(mem_key: np.ndarray, level: np.ndarray) -> np.ndarray:
    """Positions of the rows no earlier row dominates: none before it with key and level <= its own (rows in
    dominance order; one running minimum of the key per level)."""
    n = len(mem_key)
    if n <= 1:
        return np.arange(n)
    pool = np.where(level[None, :] <= np.arange(level.max() + 1)[:, None], mem_key[None, :], np.iinfo(np.int64).max)
    best = np.minimum.accumulate(pool, axis=1)
    before = np.empty(n, dtype=np.int64)
    before[0] = np.iinfo(np.int64).max
    before[1:] = best[level[1:], np.arange(n - 1)]
    return np.flatnonzero(before > mem_key)


def front_by_time(values: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated (time, memory) rows, fastest first."""
    keep = nondominated(np.concatenate([values, np.zeros((len(values), 1))], axis=1))
    return keep[np.argsort(values[keep, 0], kind="stable")]


def prune(values: np.ndarray, counts: np.ndarray, eps: float = 0.0) -> ParetoSet:
    keep = _keep(values, None, eps)
    return ParetoSet(values[keep], counts[keep])


def combine(a: ParetoSet, b: ParetoSet, eps: float = 0.0) -> ParetoSet:
    """Minkowski sum of two sets (one part after the other), pruned."""
    return combine_all([(a, b)], eps)


def combine_all(pairs: list[tuple[ParetoSet, ParetoSet]], eps: float = 0.0) -> ParetoSet:
    """Union of the Minkowski sums of several pairs, pruned once; provenance is summed only for
    the sums that survive."""
    pairs = [(a, b) for a, b in pairs if len(a) and len(b)]
    if not pairs:
        raise ValueError("no pair to combine")
    one = lambda s: ParetoSets(s.values, s.counts, np.zeros(len(s), dtype=np.int64), 1)   # noqa: E731
    out = combine_sets([(one(a), one(b)) for a, b in pairs], eps)
    return ParetoSet(out.values, out.counts)


def combine_sets(pairs: list[tuple[ParetoSets, ParetoSets]], eps: float = 0.0) -> ParetoSets:
    """Set by set, the union of the Minkowski sums of several pairs, pruned once (``combine_all`` for
    every set at once). Within a set the sums are listed pair by pair, each row of the first part
    with every row of the second, as ``combine_all`` lists them; a set summed with itself skips the
    sums (j, i) of j > i, which repeat the earlier (i, j) exactly (so are never the one kept)."""
    size = pairs[0][0].size
    values, group, left, right = [], [], [], []
    for a, b in pairs:
        i, j = _pairs(a.group, b.lengths(), b.starts(), a is b)
        va, vb = a.values[i], b.values[j]
        values.append(np.concatenate([va[:, :2] + vb[:, :2], np.maximum(va[:, 2:], vb[:, 2:])], axis=1))
        group.append(a.group[i])
        left.append(i)
        right.append(j)
    values, group = np.concatenate(values), np.concatenate(group)
    keep = _keep(values, group, eps)
    # provenance of the kept sums only: which pair, and which row of each of its parts
    pair = np.concatenate([np.full(len(i), k) for k, i in enumerate(left)])[keep]
    left, right = np.concatenate(left)[keep], np.concatenate(right)[keep]
    counts = np.empty((len(keep), pairs[0][0].counts.shape[1]), dtype=pairs[0][0].counts.dtype)
    for k, (a, b) in enumerate(pairs):
        mine = pair == k
        counts[mine] = a.counts[left[mine]] + b.counts[right[mine]]
    return ParetoSets(values[keep], counts, group[keep], size)


def _pairs(group_a: np.ndarray, lengths_b: np.ndarray, starts_b: np.ndarray,
           itself: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(row of a, row of b) for every row of a with every row of b in the same group, a-major
    (``itself``: a is b, and only j >= i)."""
    rows = np.arange(len(group_a))
    start = rows if itself else starts_b[group_a]
    reps = starts_b[group_a] + lengths_b[group_a] - start
    i = np.repeat(rows, reps)
    first = np.cumsum(reps) - reps
    j = np.repeat(start - first, reps) + np.arange(len(i))
    return i, j


def union(sets: list[ParetoSet], eps: float = 0.0) -> ParetoSet:
    sets = [s for s in sets if len(s)]
    if not sets:
        raise ValueError("union of no points")
    return prune(np.concatenate([s.values for s in sets]), np.concatenate([s.counts for s in sets]), eps)


def union_sets(sets: list[ParetoSets], eps: float = 0.0) -> ParetoSets:
    """Set by set, the union of several ``ParetoSets`` (rows of a set listed in the order of ``sets``)."""
    return ParetoSets.of(np.concatenate([s.values for s in sets]), np.concatenate([s.counts for s in sets]),
                         np.concatenate([s.group for s in sets]), sets[0].size, eps)
