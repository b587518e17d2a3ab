"""The vocabulary split over the tensor-parallel ranks: embedding, LM head and loss (Megatron-LM's layout).

Which modules are the embedding and the head, and whether the model allows the split at all, comes from
plan.json's ``vocab_parallel`` (``tensoropt.space.vocab``, derived by the launcher from the captured graph, the
same analysis the cost model prices); the runtime never guesses from names. When enabled:

- the embedding (``nn.Embedding``) gets ``RowwiseParallel``: rank r holds rows [r V/tp, (r+1) V/tp) of the
  table, looks up the tokens it holds (zeros for the others) and one all-reduce sums the ranks' partial
  embeddings (torch's ``MaskPartial``);
- the head (``nn.Linear``) gets ``ColwiseParallel`` with ``output_layouts=Shard(-1)`` and
  ``use_local_output=False``: each rank computes its V/tp logits, kept as a DTensor sharded on the vocabulary;
- the model's own ``F.cross_entropy`` then runs on the sharded logits under torch's ``loss_parallel()``, which the
  step enters around the forward *and* the backward (torch's docs require both; ``loss_context``): the
  log-softmax's max and sum are all-reduced over the ranks, and no rank ever holds the full logits.

A tied embedding and head (``lm_head.weight is wte.weight``) stay one parameter: both shard the weight on dim 0
(the vocabulary), so after sharding the head is given the embedding's DTensor parameter again, and its gradient
is the sum of both uses, as in the model run alone.

Sequence parallelism would take the embedding's output as ``Shard(1)`` (reduce-scattered along the sequence)
and the head's input as ``Shard(1)``: ``vocab_styles(sequence_parallel=True)`` names those layouts, but nothing
calls it so yet (the sequence-parallel runtime decides when it does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from ..errors import TensorOptError
from ..space.run_plan import RunPlan, VocabSplit

LossContext = Callable[[], AbstractContextManager]


def vocab_entry(run_plan: RunPlan) -> VocabSplit:
    """plan.json's ``vocab_parallel`` entry; a plan written without one keeps the vocabulary replicated."""
    return run_plan.vocab_parallel or VocabSplit(False, reason="plan.json does not say (written by an older launcher)")


def vocab_styles(sequence_parallel: bool = False) -> tuple[RowwiseParallel, ColwiseParallel]:
    """(embedding style, head style). With sequence parallelism the stream between them is split along the
    sequence (dim 1), so the embedding's sum is reduce-scattered there and the head gathers its input."""
    stream = Shard(1) if sequence_parallel else Replicate()
    return (RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False))


def apply_vocab_parallel(model: nn.Module, run_plan: RunPlan, tp_mesh) -> bool:
    """Shard the embedding and the head over ``tp_mesh`` by vocabulary as plan.json says; whether it did."""
    entry = vocab_entry(run_plan)
    if not entry.enabled:
        return False
    embedding, head = _module(model, entry.embedding, nn.Embedding), _module(model, entry.head, nn.Linear)
    check_vocab(entry, embedding, head, tp_mesh.size())
    embed_style, head_style = vocab_styles()
    parallelize_module(embedding, tp_mesh, embed_style)
    parallelize_module(head, tp_mesh, head_style)
    if entry.tied:
        head.weight = embedding.weight      # one DTensor for both uses (both Shard(0) on the same mesh)
    return True


def _module(model: nn.Module, name: str, kind: type) -> nn.Module:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise TensorOptError(f"the plan shards the vocabulary of module {name!r}, which this model does not have: "
                             "the plan was made for another model") from None
    if not isinstance(module, kind):
        raise TensorOptError(f"the plan shards the vocabulary of {name}, a {type(module).__name__} where an "
                             f"{kind.__name__} was captured: the plan was made for another model")
    return module


def check_vocab(entry: VocabSplit, embedding: nn.Embedding, head: nn.Linear, tp: int) -> None:
    """The modules hold the vocabulary the plan was made for, ``tp`` divides it, and a tie is as captured."""
    vocab = entry.vocab
    if embedding.num_embeddings != vocab or head.out_features != vocab:
        raise TensorOptError(f"the plan shards a vocabulary of {vocab}, but {entry.embedding} has "
                             f"{embedding.num_embeddings} rows and {entry.head} {head.out_features} outputs: "
                             "the plan was made for another model")
    if vocab % tp:
        raise TensorOptError(f"tensor parallelism over {tp} devices does not divide the vocabulary of {vocab}: "
                             "re-plan with `tensoropt launch`")
    if entry.tied != (head.weight is embedding.weight):
        raise TensorOptError(f"the plan says {entry.head}'s weight is {'' if entry.tied else 'not '}tied to "
                             f"{entry.embedding}'s, and in this model it is the other way: re-plan")


def loss_context(enabled: bool) -> LossContext:
    """What the step enters around each micro-batch's forward and backward: ``loss_parallel`` when the logits
    are sharded by vocabulary, else nothing."""
    return loss_parallel if enabled else contextlib.nullcontext


__all__ = ["LossContext", "apply_vocab_parallel", "check_vocab", "loss_context", "vocab_entry", "vocab_styles"]
