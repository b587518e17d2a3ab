"""Which features of a producer's output a view reads: what tensor parallelism must know about fused projections.

Views are not ops in the graph (``graph.ir``): a consumer of ``qkv.split(n, dim=-1)[1]`` points straight at
the linear that produced ``qkv``. Whether that linear can be sharded by output features depends on *which*
features each consumer reads, so capture records it per input as a *footprint*: the set of positions
within one row of the producer's output (its last dimension, ``N`` features) that the view covers, as an
affine lattice ``offset + sum(i_d * stride_d)`` over ``0 <= i_d < size_d``. Rows (batch, sequence) are
left out: tensor parallelism splits features, never rows.

Encoding (``Op.input_views``): ``()`` for every feature in order (the common case, kept empty so graphs stay
small), ``(offset, size_0, stride_0, size_1, stride_1, ...)`` with strides decreasing and adjacent
dimensions merged where they are contiguous, and ``IRREGULAR`` when the view is not such a lattice (it
crosses rows unevenly, or its producer is not laid out row-major).

Examples for ``qkv`` of ``N = 3C`` features: ``qkv.split(C, -1)[1]`` reads ``(C, 1, 1)`` at offset ``C``:
``(C, C, 1)``; viewed per head first, ``qkv.view(b, s, H, 3, d)[..., 1, :]`` reads ``(d, H, 3d, d, 1)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:        # only annotations: the planner reads captured graphs without importing torch
    import torch

IRREGULAR = (-1,)
FULL: tuple[int, ...] = ()
EMPTY = (0, 0, 1)          # a view of no element (``x[..., d:]`` with nothing left) reads nothing


def footprint(view: torch.Tensor, producer: torch.Tensor) -> tuple[int, ...]:
    """The features of ``producer``'s last dimension that ``view`` (a view of its storage) reads."""
    if view is producer or producer.dim() == 0:
        return FULL
    if view.numel() == 0:
        return EMPTY
    features = producer.shape[-1]
    if not producer.is_contiguous() or features == 0:
        return FULL if _same_geometry(view, producer) else IRREGULAR
    offset = view.storage_offset() - producer.storage_offset()
    if offset < 0:
        return IRREGULAR
    dims = []
    for size, stride in zip(view.shape, view.stride()):
        if size == 1 or stride == 0:                 # broadcast (expand): the same features again
            continue
        if stride >= features:                       # steps over whole rows
            if stride % features:
                return IRREGULAR
            continue
        if size * stride > features:                 # spans rows: keep its within-row part only
            if features % stride or size % (features // stride):
                return IRREGULAR
            size = features // stride
        dims.append((size, stride))
    dims = _merged(sorted(dims, key=lambda d: -d[1]))
    start = offset % features
    if start + sum((size - 1) * stride for size, stride in dims) >= features:
        return IRREGULAR
    if start == 0 and dims == [(features, 1)]:
        return FULL
    return (start, *[x for d in dims for x in d])


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def _merged(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Fuse an outer dimension with the next inner one where together they are contiguous."""
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def lattice(view: tuple[int, ...], features: int) -> tuple[int, list[tuple[int, int]]]:
    """(offset, [(size, stride), ...]) of a footprint; the whole row for ``FULL``."""
    if view == FULL:
        return 0, [(features, 1)]
    return view[0], list(zip(view[1::2], view[2::2]))


__all__ = ["EMPTY", "FULL", "IRREGULAR", "footprint", "lattice"]
