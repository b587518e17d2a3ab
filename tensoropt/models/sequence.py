"""The part of each sample's sequence this process computes: all of it, or under context parallelism its share.

Context parallelism splits every sample's sequence over ``cp`` ranks. A model cannot learn that from its input
alone: a rank holding tokens 0-63 and 192-255 of a 256-token sample sees a 128-token input, but its positions
(learned embeddings, rotary tables), its causal mask and the keys its queries attend to are those of the whole
sequence. So a model that can run context-parallel reads its share here (``current_shard()``): None when it
computes whole sequences (one process, data or tensor parallelism, the capture), else a ``SequenceShard`` that the
runtime sets for the whole life of a context-parallel worker (``runtime.parallel.context_parallel``; for good, not
around a forward: recomputation runs a block's forward again inside the backward).

This module is the library's side of that contract and has no process groups: the runtime hands in the function
that gathers the other ranks' keys and values. ``models.transformer.DecoderLM`` reads it and says so with a
``context_parallel_refusal()`` method; a model that does not (user code, Hugging Face models) is never given a plan
with ``cp > 1`` (``graph.ir.CONTEXT_PARALLEL_META``, recorded at capture).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceShard:
    """This rank's tokens of every sample: ``chunks`` (start, stop) ranges of the whole sequence, in the order its
    input holds them; ``gather(x, dim)`` returns the keys or values of all ranks' tokens along ``dim`` in sequence
    order (differentiable: its backward sums every rank's gradient into the owner's share); ``saving()`` is entered
    around the attention that reads them."""

    chunks: tuple[tuple[int, int], ...]
    length: int                                           # the whole sequence
    gather: Callable[[torch.Tensor, int], torch.Tensor]
    # entered around the attention on gathered tensors: what its backward keeps of them (the runtime keeps the
    # rank's share and gathers again in the backward); by default what autograd keeps
    saving: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # per chunk, the bottom-right causal bias of its queries against the keys up to its end
    # (``torch.nn.attention.bias.causal_lower_right``), made once by the runtime (outside any fake-tensor mode, where
    # a tensor subclass cannot be made); empty: each forward makes its own
    lower_right: tuple = ()

    @property
    def tokens(self) -> int:
        return sum(stop - start for start, stop in self.chunks)

    def positions(self, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's tokens, in input order (int64)."""
        return torch.cat([torch.arange(start, stop, device=device) for start, stop in self.chunks])

    def check(self, tokens: int) -> None:
        if tokens != self.tokens:
            raise ValueError(f"a context-parallel rank holds {self.tokens} tokens of each {self.length}-token sample, "
                             f"the model got {tokens}: train at the sequence length the plan was made for")


_current: SequenceShard | None = None


def current_shard() -> SequenceShard | None:
    """The shard this process computes (module doc), None for whole sequences."""
    return _current


def use_shard(shard: SequenceShard | None) -> None:
    """Set (or with None clear) the process's shard: the runtime's call, once per worker."""
    global _current
    _current = shard


__all__ = ["SequenceShard", "current_shard", "use_shard"]
