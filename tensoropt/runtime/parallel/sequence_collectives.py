"""The sequence-parallel collectives of a batch-1 stream without torch's layout copies.

Our stream is batch-first, [b, s, h], and sequence parallelism shards it along the sequence, dim 1. torch's
``Shard(1)`` redistribution runs its collectives along dim 0 and moves the data between the two layouts
(``torch.distributed._functional_collectives``): a reduce-scatter first concatenates the input's chunks along the
sequence into a new tensor, always; an all-gather's result is moved to dim 1, a view at batch 1. At batch 1 the
ranks' chunks along the sequence are consecutive slabs of memory, so both collectives can run on views: these two
functions do (a gather whose backward reduce-scatters, and a reduce-scatter whose backward gathers), as Megatron-LM's
sequence-first stream needs no copy at any batch. Past batch 1, or under ``torch.compile`` (which traces torch's
redistribution), torch's own path runs: ``cost.tp_copies`` prices whichever runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

SEQUENCE_DIM = 1       # the sequence dim of the batch-first stream, which SP shards


def partial_sum(t: DTensor) -> bool:
    """Whether every placement of ``t`` is a partial sum over its ranks (a row linear's output, a column linear's
    input gradient)."""
    return all(p.is_partial() and p.reduce_op == "sum" for p in t.placements)


def runs_on_views(t: DTensor) -> bool:
    """Whether the collectives of ``t`` (a DTensor on a 1-D mesh) can run on views: batch 1, eager."""
    return t.dim() > SEQUENCE_DIM and t.shape[0] == 1 and t.device_mesh.ndim == 1 \
        and not torch.compiler.is_compiling()


def _gather(local: torch.Tensor, mesh) -> torch.Tensor:
    """[1, s/tp, ...] shares -> [1, s, ...], gathered along dim 0 into one buffer, viewed in sequence order."""
    tp = mesh.size()
    local = local.contiguous()
    whole = local.new_empty((tp * local.shape[SEQUENCE_DIM], *local.shape[SEQUENCE_DIM + 1:]))
    dist.all_gather_into_tensor(whole, local.view(local.shape[SEQUENCE_DIM:]), group=mesh.get_group())
    return whole.unsqueeze(0)


def _scatter(partial: torch.Tensor, mesh) -> torch.Tensor:
    """[1, s, ...] partial sums -> the rank's [1, s/tp, ...] of their sum, reduce-scattered from a view."""
    tp = mesh.size()
    partial = partial.contiguous()
    share = partial.new_empty((partial.shape[SEQUENCE_DIM] // tp, *partial.shape[SEQUENCE_DIM + 1:]))
    dist.reduce_scatter_tensor(share, partial.view(partial.shape[SEQUENCE_DIM:]), group=mesh.get_group())
    return share.unsqueeze(0)


def _own_share(whole: torch.Tensor, mesh) -> torch.Tensor:
    tp, rank = mesh.size(), mesh.get_local_rank()
    return whole.chunk(tp, dim=SEQUENCE_DIM)[rank]


class GatherSequence(torch.autograd.Function):
    """The rank's ``Shard(1)`` share -> the ``Replicate`` whole; backward: a ``Partial`` gradient reduce-scattered to
    the share (a replicated one sliced)."""

    @staticmethod
    def forward(ctx, share: DTensor) -> DTensor:
        ctx.mesh = mesh = share.device_mesh
        return DTensor.from_local(_gather(share._local_tensor, mesh), mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        mesh, local = ctx.mesh, grad._local_tensor
        share = _scatter(local, mesh) if grad.placements[0].is_partial() else _own_share(local, mesh).contiguous()
        return DTensor.from_local(share, mesh, [Shard(SEQUENCE_DIM)], run_check=False)


class ScatterSequence(torch.autograd.Function):
    """A row linear's ``Partial`` output -> the rank's ``Shard(1)`` share of the sum; backward: the share's gradient
    gathered whole (the gradient of every rank's partial output)."""

    @staticmethod
    def forward(ctx, partial: DTensor) -> DTensor:
        ctx.mesh = mesh = partial.device_mesh
        return DTensor.from_local(_scatter(partial._local_tensor, mesh), mesh, [Shard(SEQUENCE_DIM)], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        mesh = ctx.mesh
        local = grad._local_tensor if grad.placements[0].is_shard() else _own_share(grad.full_tensor(), mesh)
        return DTensor.from_local(_gather(local, mesh), mesh, [Replicate()], run_check=False)


def gather_sequence(share: DTensor, mesh) -> DTensor:
    """The whole of a ``Shard(1)`` share: on views where it can (``runs_on_views``), else by torch's redistribution."""
    if runs_on_views(share) and share.placements == (Shard(SEQUENCE_DIM),):
        return GatherSequence.apply(share)
    return share.redistribute(mesh, [Replicate()])


def scatter_sequence(partial: DTensor) -> DTensor | None:
    """A ``Partial`` (sum) DTensor's ``Shard(1)`` share on views where it can; None where torch's path must run."""
    if runs_on_views(partial) and partial_sum(partial):
        return ScatterSequence.apply(partial)
    return None


__all__ = ["GatherSequence", "ScatterSequence", "gather_sequence", "partial_sum", "runs_on_views", "scatter_sequence"]
