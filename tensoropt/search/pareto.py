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


def nondominated(values: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated rows of ``values`` (minimisation), duplicates kept once.

    Exact: the third column is split into its distinct levels; a point is dominated iff a point
    of its level or a lower one comes before it in (time, memory) order with memory <= its memory.
    """
    n = len(values)
    if n <= 1:
        return np.arange(n)
    idx = np.lexsort((values[:, 2], values[:, 1], values[:, 0]))   # by time, then memory, then transient
    v = values[idx]
    distinct = np.concatenate(([True], np.any(v[1:] != v[:-1], axis=1)))   # duplicates are adjacent now
    v, idx = v[distinct], idx[distinct]
    keep = np.zeros(len(v), dtype=bool)
    levels = np.unique(v[:, 2])
    for level in levels:
        pool = v[:, 2] <= level                        # points that can dominate this level
        mem = np.where(pool, v[:, 1], np.inf)
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(mem)[:-1]))
        at_level = v[:, 2] == level
        keep[at_level] = best_before[at_level] > v[at_level, 1]
    return idx[keep]


def _keep(values: np.ndarray, eps: float) -> np.ndarray:
    """Indices to keep. With eps > 0 dominance is decided on values rounded up to a (1 + eps) grid,
    but the kept points keep their exact values (so they still price exactly as ``estimate``)."""
    if eps > 0 and len(values):
        grid = np.log1p(eps)
        snapped = np.where(values > 0, np.exp(np.ceil(np.log(np.maximum(values, 1e-300)) / grid) * grid), values)
        # among points equal on the grid, the stable pass keeps the first: make it the exactly best
        order = np.lexsort((values[:, 2], values[:, 1], values[:, 0]))
        return order[nondominated(snapped[order])]
    return nondominated(values)


def prune(values: np.ndarray, counts: np.ndarray, eps: float = 0.0) -> ParetoSet:
    keep = _keep(values, eps)
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
    blocks, owners = [], []
    for k, (a, b) in enumerate(pairs):
        va, vb = a.values[:, None, :], b.values[None, :, :]
        blocks.append(np.concatenate([va[..., :2] + vb[..., :2], np.maximum(va[..., 2:], vb[..., 2:])],
                                     axis=2).reshape(-1, 3))
        owners.append(np.full(len(a) * len(b), k))
    values = np.concatenate(blocks)
    keep = _keep(values, eps)
    offsets = np.cumsum([0] + [len(v) for v in blocks])
    counts = []
    for k in keep:
        a, b = pairs[owners_k := int(np.searchsorted(offsets, k, side="right") - 1)]
        i, j = divmod(int(k - offsets[owners_k]), len(b))
        counts.append(a.counts[i] + b.counts[j])
    return ParetoSet(values[keep], np.array(counts))


def union(sets: list[ParetoSet], eps: float = 0.0) -> ParetoSet:
    sets = [s for s in sets if len(s)]
    if not sets:
        raise ValueError("union of no points")
    return prune(np.concatenate([s.values for s in sets]), np.concatenate([s.counts for s in sets]), eps)
