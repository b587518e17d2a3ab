"""How a column-parallel linear's output features may be split over ranks: fused projections.

A column-parallel linear is sharded by output features. Megatron-LM's rule is that every rank must then
hold whole units of what the branch computes (heads, groups of heads) *in the order the model's code
reads them*. From the features each consumer reads (``graph.views``) a linear's output is one of:

- ``whole``: read in order (``view(b, s, heads, d)``): rank r holds the r-th contiguous block of features;
- ``groups``: read as G equal interleaved groups, each reader striding over whole groups
  (``qkv.view(b, s, G, 3, d)``, the per-head / per-group fused QKV layout): the contiguous blocks hold whole
  groups, so the plain split is right whenever tp divides G;
- ``segments``: read as contiguous segments (``qkv.split(C, -1)``, ``[q | k | v]`` sliced by size,
  ``gate_up.chunk(2, -1)``): rank r must hold the r-th part of *every* segment, ``[q_r | k_r | v_r]``,
  which the runtime arranges by ordering the weight's rows (or columns, for ``Conv1D``) before the split;
- anything else (a reader mixing both, a row that does not tile, a normalisation or reduction over features
  that several ranks hold): not shardable, so the branch stays replicated and is never priced sharded.

This module only reads the captured graph; whether the model's code computes its split sizes from the
tensor (``chunk(3)``) or hard-codes them (``split(n_embd)``) cannot be seen here and is checked by running
the sharded block on fake tensors at capture (``space.tp_check``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.ir import Op
from ..graph.views import EMPTY, FULL, IRREGULAR, lattice

_FEATURE_PRESERVING = ("elementwise", "dropout")
_REDUCING = ("norm", "softmax", "reduction")


@dataclass(frozen=True)
class FeatureLayout:
    """How one column-parallel linear's output features are read (see the module doc): contiguous
    segments in feature order, each read whole or as interleaved groups."""

    segments: tuple[int, ...]            # segment sizes in feature order; one segment: the whole row
    groups: tuple[int, ...]              # per segment, its interleaved groups (0: read in order)

    @property
    def kind(self) -> str:
        return "segments" if len(self.segments) > 1 else "groups" if self.groups[0] else "whole"

    @property
    def units(self) -> tuple[int, ...]:
        """Counts every tensor-parallel degree must divide."""
        if self.kind == "whole":
            return ()
        return tuple(g or size for size, g in zip(self.segments, self.groups))


def feature_layout(ops: tuple[Op, ...], column: int, features: int) -> FeatureLayout | str:
    """The layout of op ``column``'s output (``features`` wide), or why it cannot be split."""
    reads: list[tuple[int, ...]] = []
    frontier, seen = [column], {column}
    while frontier:
        producer = frontier.pop()
        for op in ops:
            for k, ref in enumerate(op.sources):
                if ref.kind != "local" or ref.index != producer:
                    continue
                view = op.input_view(k)
                if op.kind in _REDUCING and op.inputs[k].shape[-1:] == (_count(view, features),):
                    return f"{op.target} reduces over features that several ranks would hold"
                if op.kind in _FEATURE_PRESERVING and view == FULL and op.inputs[k].shape[-1:] == (features,) \
                        and op.outputs and op.outputs[0].shape == op.inputs[k].shape:
                    if op.index not in seen:
                        seen.add(op.index)
                        frontier.append(op.index)
                    continue
                if view != EMPTY:
                    reads.append(view)
    return _classify(reads, features)


def _count(view: tuple[int, ...], features: int) -> int:
    _, dims = lattice(view, features)
    count = 1
    for size, _ in dims:
        count *= size
    return count


def _classify(reads: list[tuple[int, ...]], features: int) -> FeatureLayout | str:
    if IRREGULAR in reads:
        return "a reader's view of its output is not a regular pattern of features"
    spans = sorted({_span(v, features) for v in reads})
    edges, merged = [0], []
    for start, end in spans:                          # overlapping reads belong to one segment
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    for start, end in merged:
        edges += [start, end]
    edges = sorted(set(edges + [features]))
    segments = list(zip(edges, edges[1:]))
    groups = []
    for lo, hi in segments:
        inside = [v for v in reads if lo <= _span(v, features)[0] < hi]
        count = _groups(inside, lo, hi - lo, features)
        if isinstance(count, str):
            return count
        groups.append(count)
    return FeatureLayout(tuple(hi - lo for lo, hi in segments), tuple(groups))


def _span(view: tuple[int, ...], features: int) -> tuple[int, int]:
    offset, dims = lattice(view, features)
    return offset, offset + sum((size - 1) * stride for size, stride in dims) + 1


def _groups(reads: list[tuple[int, ...]], lo: int, size: int, features: int) -> int | str:
    """0 when every read takes segment [lo, lo + size) whole and in order, the number of groups when
    every read strides over equal groups of it, else why not."""
    whole = [(lo, size, 1)] if lo or size != features else [FULL]
    patterns = [v for v in reads if v not in whole and not (v == FULL and lo == 0 and size == features)]
    if not patterns:
        return 0
    strides = set()
    for v in patterns:
        offset, dims = lattice(v, features)
        (count, stride) = dims[0]
        if offset - lo >= stride or count * stride != size or size % stride:
            return "its readers take features in patterns that no split by ranks keeps whole"
        strides.add(stride)
    if len(strides) > 1:
        return "its readers group its features in different ways"
    return size // strides.pop()


def segment_order(segments: tuple[int, ...], tp: int) -> list[int]:
    """The feature order that makes a contiguous split over ``tp`` ranks give rank r the r-th part of every
    segment: rank 0's parts of all segments, then rank 1's, ... (a permutation of range(sum(segments)))."""
    order = []
    for rank in range(tp):
        start = 0
        for size in segments:
            part = size // tp
            order += range(start + rank * part, start + (rank + 1) * part)
            start += size
    return order


__all__ = ["FeatureLayout", "feature_layout", "segment_order"]
