"""Context parallelism for the torch engine: each sample's sequence split over the ``cp`` ranks of a data-parallel
replica (``Plan.cp``), the keys and values of the whole sequence gathered in every attention.

Layout (as Megatron-LM's and torchtitan's load-balanced causal CP lay it out): the sequence of S tokens is cut
into 2 x cp chunks and cp rank r holds chunks r and 2cp-1-r, so that under a causal mask every rank's queries see
the same number of keys (an early chunk and a late one). ``shard_batch`` cuts every sequence tensor of a
micro-batch so (token ids and labels alike: a label stays with its token, so a model whose labels are already
shifted, as ``DecoderLM``'s are, computes the same per-token losses).

Attention: the model reads the shard (``models.sequence``) and calls ``gather`` on its keys and values after the
rotary embedding: one all-gather of each over the cp ranks (``all_gather_single``), synchronous, then the
rank's queries attend to all S keys under the causal mask's rows of their positions. Its backward reduce-scatters
the gradients of the gathered keys and values (``reduce_scatter_single``, summed: every rank's queries read every
rank's keys) back to their owners. This is the all-gather form of CP (Megatron-LM's ``--cp-comm-type allgather``,
torchtitan's ``context_parallel_rotate_method="allgather"``) without their overlap of the gather with the first
chunk's attention: what ``cost`` prices (a ring that overlaps would be a later change of both).

Gradients: each rank's loss is the mean over its S/cp tokens of each sample; every rank holds the same number of
tokens, so the mean of the ranks' losses is the whole sequence's mean loss, and data parallelism over the dp x cp
ranks (DDP's averaging, FSDP2's reduce-scatter over the flattened mesh) averages the ranks' gradients into its
gradient (the keys' and values' share of it arrives through the reduce-scatter above).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ... import collective_api
from ...errors import TensorOptError
from ...models.sequence import SequenceShard, use_shard


def chunks(length: int, cp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (start, stop) ranges of the sequence that cp rank ``rank`` holds, in the order its input holds them."""
    if length % (2 * cp):
        raise TensorOptError(f"context parallelism over {cp} ranks cuts each sequence into {2 * cp} equal chunks: a "
                             f"sequence of {length} tokens does not split so; use a sequence length divisible by "
                             f"{2 * cp} or another --cp")
    size = length // (2 * cp)
    return (rank * size, (rank + 1) * size), ((2 * cp - 1 - rank) * size, (2 * cp - rank) * size)


def shard_batch(batch, length: int, cp: int, rank: int):
    """This cp rank's tokens of a micro-batch: every tensor whose dim 1 is the sequence (``length`` long) cut to the
    rank's chunks along it; other values (a per-sample tensor, a flag) whole."""
    spans = chunks(length, cp, rank)

    def take(x):
        if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == length):
            return x
        return torch.cat([x[:, start:stop] for start, stop in spans], dim=1)
    if isinstance(batch, Mapping):
        return {k: take(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(take(v) for v in batch)
    return take(batch)


def _gathered_order(cp: int) -> torch.Tensor:
    """For each chunk of the sequence in order, where the all-gather put it: rank-major, each rank's two chunks."""
    return torch.tensor([2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)])


def _all_gather(x: torch.Tensor, dim: int, group, cp: int) -> torch.Tensor:
    """Every cp rank's ``x`` (its chunks along ``dim``) as the whole sequence in order, one all-gather; the same
    layout (strides) every call, which ``_Shares`` relies on."""
    local = x.movedim(dim, 0).contiguous()
    gathered = local.new_empty((cp * local.shape[0], *local.shape[1:]))
    collective_api.all_gather_single(gathered, local, group=group)
    order = _gathered_order(cp).to(x.device)
    pieces = gathered.view(2 * cp, local.shape[0] // 2, *local.shape[1:]).index_select(0, order)
    return pieces.reshape(gathered.shape).movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    """All ranks' tokens along ``dim`` in sequence order (forward: all-gather; backward: reduce-scatter, summed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, cp: int, shares: _Shares) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.cp = dim, group, cp
        out = _all_gather(x, dim, group, cp)
        ctx.share = shares.add(out, x.detach(), dim, group, cp)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        ctx.share.release()              # every reader's backward has run: the tensor gathered again is done
        whole = grad.movedim(ctx.dim, 0)                  # a view: splitting its first dim below is one too
        inverse = torch.argsort(_gathered_order(cp)).to(grad.device)
        rank_major = whole.unflatten(0, (2 * cp, -1)).index_select(0, inverse).flatten(0, 1)   # the one copy
        mine = rank_major.new_empty((whole.shape[0] // cp, *whole.shape[1:]))
        collective_api.reduce_scatter_single(mine, rank_major, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None, None, None


class _Share:
    """How one gathered tensor is gathered again in the backward from the share autograd kept, once: the views of it
    that autograd saved (two chunks' keys under flash attention) share that tensor until the gather's own backward
    releases it, after every reader's backward. It holds no share itself: the gather's node keeps it until the
    backward, and a share held there would outlive a full recomputation that drops it."""

    def __init__(self, dim: int, group, cp: int) -> None:
        self.dim, self.group, self.cp = dim, group, cp
        self._whole: torch.Tensor | None = None

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        if self._whole is None:
            with torch.no_grad():
                self._whole = _all_gather(local, self.dim, self.group, self.cp)
        return self._whole

    def release(self) -> None:
        self._whole = None


class _Kept:
    """A saved view of a gathered tensor, kept as its share: ``inner`` is what the outer pair packed the share as."""

    def __init__(self, share: _Share, inner, size: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.share, self.inner, self.size, self.stride, self.offset = share, inner, size, stride, offset


class _Shares:
    """Saved-tensor hooks that keep a gathered key or value, or a view of it, as the rank's share of it (Transformer
    Engine's all-gather CP keeps its local K and V and gathers them again in the backward, as here): autograd would
    keep the whole sequence's keys and values of every layer until its backward. The gathered tensors are known by
    their storage (``add``, as the gather makes them), so a view autograd saves (a transpose for Q K^T) is found too
    and comes back as the same view of the tensor gathered again. The pair composes with the one innermost when the
    attention starts (a full recomputation's, as ``sequence_parallel._SavedShares`` does): every tensor goes on to it,
    a gathered one as its share, so recomputation still drops and recomputes what it would."""

    def __init__(self) -> None:
        self._gathered: dict = {}      # StorageWeakRef -> (the rank's share, _Share), while the gathered tensor lives

    def add(self, gathered: torch.Tensor, local: torch.Tensor, dim: int, group, cp: int) -> _Share:
        key = StorageWeakRef(gathered.untyped_storage())
        share = _Share(dim, group, cp)
        self._gathered[key] = (local, share)
        weakref.finalize(gathered, self._gathered.pop, key, None)
        return share

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor):
            gathered = self._gathered.get(StorageWeakRef(t.untyped_storage()))
            if gathered is None:
                return t if outer_pack is None else outer_pack(t)
            local, share = gathered
            inner = local if outer_pack is None else outer_pack(local)
            return _Kept(share, inner, t.size(), t.stride(), t.storage_offset())

        def unpack(packed):
            if not isinstance(packed, _Kept):
                return packed if outer_unpack is None else outer_unpack(packed)
            local = packed.inner if outer_unpack is None else outer_unpack(packed.inner)
            return packed.share.whole(local).as_strided(packed.size, packed.stride, packed.offset)
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def install(group, cp: int, rank: int, length: int) -> SequenceShard:
    """Make this worker compute cp rank ``rank``'s share of every ``length``-token sequence (``models.sequence``),
    gathering keys and values over ``group``, for the rest of its life."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.nn.attention.bias import causal_lower_right
    spans, shares = chunks(length, cp, rank), _Shares()
    with unset_fake_temporarily():         # the memory check applies the plan under a fake-tensor mode
        biases = tuple(causal_lower_right(stop - start, stop) for start, stop in spans)
    shard = SequenceShard(chunks=spans, length=length,
                          gather=lambda x, dim: _GatherSequence.apply(x, dim, group, cp, shares),
                          saving=shares.saving, lower_right=biases)
    use_shard(shard)
    return shard


__all__ = ["chunks", "install", "shard_batch"]
