"""The sequence-parallel collectives of a batch-first stream with fewer of torch's layout copies.

Our stream is batch-first, [b, s, h], and sequence parallelism shards it along the sequence, dim 1. torch's
``Shard(1)`` redistribution runs its collectives along dim 0 and moves the data between the two layouts
(``torch.distributed._functional_collectives``): a reduce-scatter first concatenates the input's chunks along the
sequence into a new tensor, always; an all-gather's result is moved to dim 1, a copy past batch 1. Each sample's
sequence is one slab of memory, and the ranks' chunks of it consecutive slabs, so:
- an all-gather runs per sample on views of one buffer, the b of them coalesced into one collective
  (``torch.distributed._coalescing_manager``: one NCCL group; gloo flattens them into one all-gather): no copy at
  any batch, as Megatron-LM's sequence-first stream needs none;
- a reduce-scatter runs on views at batch 1; past it, on the chunks concatenated rank by rank (one copy, as torch
  makes): gloo runs coalesced reduce-scatters one at a time (~7x the time of one on the concatenation at
  micro-batch 8 on this project's CPU runners), so per-sample reduce-scatters, which NCCL would group, would be
  a second code path for GPUs alone.
These two functions do that (a gather whose backward reduce-scatters, and a reduce-scatter whose backward gathers),
and ``gathered`` gathers a saved share again in the backward. Under ``torch.compile`` (which traces torch's
redistribution) torch's own path runs: ``cost.tp_copies`` prices whichever runs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ... import collective_api

SEQUENCE_DIM = 1       # the sequence dim of the batch-first stream, which SP shards


def partial_sum(t: DTensor) -> bool:
    """Whether every placement of ``t`` is a partial sum over its ranks (a row linear's output, a column linear's
    input gradient)."""
    return all(p.is_partial() and p.reduce_op == "sum" for p in t.placements)


def runs_in_place(t: DTensor) -> bool:
    """Whether the collectives of ``t`` (a DTensor on a 1-D mesh) run on this module's buffers (module doc): eager."""
    return t.dim() > SEQUENCE_DIM and t.device_mesh.ndim == 1 and not torch.compiler.is_compiling()


def _coalesced(group, samples: int):
    """One collective per sample, launched as one where there are several. The fake process group of the memory
    simulations and the layout probes (``runtime.memory.check``, ``layout_probe``) has no coalesced collectives:
    there each runs on its own, into the same buffers (its collectives move nothing)."""
    if samples == 1 or dist.get_backend(group) == "fake":
        return contextlib.nullcontext()
    return dist._coalescing_manager(group=group)


def _gather(local: torch.Tensor, mesh) -> torch.Tensor:
    """[b, s/tp, ...] shares -> [b, s, ...]: each sample's shares gathered along dim 0 of its own slab."""
    group, local = mesh.get_group(), local.contiguous()
    whole = local.new_empty((local.shape[0], mesh.size() * local.shape[SEQUENCE_DIM], *local.shape[SEQUENCE_DIM + 1:]))
    with _coalesced(group, local.shape[0]):
        for sample in range(local.shape[0]):
            collective_api.all_gather_single(whole[sample], local[sample], group=group)
    return whole


def _scatter(partial: torch.Tensor, mesh) -> torch.Tensor:
    """[b, s, ...] partial sums -> the rank's [b, s/tp, ...] of their sum: reduce-scattered from a view at batch 1,
    from the ranks' chunks concatenated past it (module doc)."""
    tp, group = mesh.size(), mesh.get_group()
    share = partial.new_empty((partial.shape[0], partial.shape[SEQUENCE_DIM] // tp, *partial.shape[SEQUENCE_DIM + 1:]))
    if partial.shape[0] == 1:        # the ranks' chunks are consecutive slabs of the one sample: dim 0 of a view
        collective_api.reduce_scatter_single(share[0], partial.contiguous()[0], group=group)
    else:
        collective_api.reduce_scatter_single(share, torch.cat(partial.chunk(tp, SEQUENCE_DIM)), group=group)
    return share


def _whole(share: DTensor) -> DTensor:
    """The ``Replicate`` whole of a ``Shard(1)`` share, gathered per sample (``_gather``)."""
    mesh = share.device_mesh
    return DTensor.from_local(_gather(share._local_tensor, mesh), mesh, [Replicate()], run_check=False)


def _own_share(whole: torch.Tensor, mesh) -> torch.Tensor:
    tp, rank = mesh.size(), mesh.get_local_rank()
    return whole.chunk(tp, dim=SEQUENCE_DIM)[rank]


class GatherSequence(torch.autograd.Function):
    """The rank's ``Shard(1)`` share -> the ``Replicate`` whole; backward: a ``Partial`` gradient reduce-scattered to
    the share (a replicated one sliced)."""

    @staticmethod
    def forward(ctx, share: DTensor) -> DTensor:
        ctx.mesh = share.device_mesh
        return _whole(share)

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


def _sharded(share: DTensor) -> bool:
    return runs_in_place(share) and share.placements == (Shard(SEQUENCE_DIM),)


def gather_sequence(share: DTensor, mesh) -> DTensor:
    """The whole of a ``Shard(1)`` share: on views where it can (``runs_in_place``), else by torch's redistribution."""
    if _sharded(share):
        return GatherSequence.apply(share)
    return share.redistribute(mesh, [Replicate()])


def gathered(share: DTensor) -> DTensor:
    """The whole of a ``Shard(1)`` share outside autograd: a kept input gathered again in the backward."""
    return _whole(share) if _sharded(share) else share.redistribute(share.device_mesh, [Replicate()])


def scatter_sequence(partial: DTensor) -> DTensor | None:
    """A ``Partial`` (sum) DTensor's ``Shard(1)`` share on views where it can; None where torch's path must run."""
    if runs_in_place(partial) and partial_sum(partial):
        return ScatterSequence.apply(partial)
    return None


__all__ = ["GatherSequence", "ScatterSequence", "gather_sequence", "gathered", "partial_sum", "runs_in_place",
           "scatter_sequence"]
