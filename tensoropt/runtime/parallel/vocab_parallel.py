"""The vocabulary split over the tensor-parallel ranks: embedding, LM head and loss (Megatron-LM's layout).

Which modules are the embedding and the head, and whether the model allows the split at all, comes from
plan.json's ``vocab_parallel`` (``tensoropt.space.vocab``, derived by the launcher from the captured graph, the
same analysis the cost model prices); the runtime never guesses from names. When enabled:

- the embedding (``nn.Embedding``) gets ``VocabEmbedding``: rank r holds rows [r V/tp, (r+1) V/tp) of the table
  (a ``Shard(0)`` DTensor), looks up the tokens it holds in its own rows (zeros for the others) and one all-reduce
  sums the ranks' partial embeddings, whose backward hands each rank the whole output gradient (Megatron-LM's
  ``VocabParallelEmbedding``: ``reduce_from_tensor_model_parallel_region``). So the backward makes the gradient of
  the rank's rows only; torch's ``RowwiseParallel`` (``MaskPartial``) computed the whole table's gradient on every
  rank and reduced it to the shard after (``_embedding_ops.py``: no vocabulary-sharded rule for its backward): a
  transient V x h per rank, 8.8 GiB for Nemotron-4 340B's table in bf16;
- the head (``nn.Linear``) gets ``ColwiseParallel`` with ``output_layouts=Shard(-1)`` and
  ``use_local_output=False``: each rank computes its V/tp logits, kept as a DTensor sharded on the vocabulary;
- the model's own ``F.cross_entropy`` then runs on the sharded logits as Megatron-LM's does (``vocab_loss``: the
  rows' max and sum all-reduced over the ranks, one float32 share saved and turned into the gradient in place),
  and any other op on them under torch's ``loss_parallel()``; the step enters both around the forward *and* the
  backward (``loss_context``). No rank ever holds the full logits.

A tied embedding and head (``lm_head.weight is wte.weight``) stay one parameter: both shard the weight on dim 0
(the vocabulary), so after sharding the head is given the embedding's DTensor parameter again, and its gradient
is the sum of both uses, as in the model run alone.

Under sequence parallelism the stream enters the first sequence-parallel copy whole and leaves the last whole
(``runtime.parallel.sequence_parallel``), so the embedding and the head see it whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from ...errors import TensorOptError
from ...space.run_plan import RunPlan, VocabSplit
from .vocab_loss import fused_loss

LossContext = Callable[[], AbstractContextManager]


def vocab_entry(run_plan: RunPlan) -> VocabSplit:
    """plan.json's ``vocab_parallel`` entry; a plan written without one keeps the vocabulary replicated."""
    return run_plan.vocab_parallel or VocabSplit(False, reason="plan.json does not say (written by an older launcher)")


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) in the forward, the gradient handed on as it is in the backward: every rank's partial
    embedding is added into the output every rank uses (Megatron-LM's ``_ReduceFromModelParallelRegion``)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist
        ctx.mark_dirty(partial)             # summed in place: the rank's partial embedding is not kept
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class VocabEmbedding(ParallelStyle):
    """An ``nn.Embedding`` split by vocabulary over a 1-D mesh, looked up on each rank's own rows (module doc)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.max_norm is not None or module.sparse:
            raise TensorOptError(f"the vocabulary split runs plain nn.Embedding tables: {module} has max_norm or "
                                 "sparse gradients; plan with --tp 1")
        weight = module.weight
        module.register_parameter("weight", nn.Parameter(distribute_tensor(weight.detach(), device_mesh, [Shard(0)]),
                                                         requires_grad=weight.requires_grad))
        group = device_mesh.get_group()

        def forward(ids: torch.Tensor) -> torch.Tensor:
            table = module.weight.to_local()
            rows = table.shape[0]
            start = device_mesh.get_local_rank() * rows
            outside = (ids < start) | (ids >= start + rows)
            padding = module.padding_idx - start if module.padding_idx is not None and \
                start <= module.padding_idx < start + rows else None
            partial = F.embedding((ids - start).masked_fill(outside, 0), table, padding)
            return _SumOverRanks.apply(partial.masked_fill(outside.unsqueeze(-1), 0), group)
        module.forward = forward
        return module


def vocab_styles() -> tuple[ParallelStyle, ColwiseParallel]:
    """(embedding style, head style). The embedding's output is whole (each copy that runs sequence-parallel slices
    its share); the head computes its V/tp logits from a whole input."""
    return VocabEmbedding(), ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                             use_local_output=False)


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


def loss_context(enabled: bool, lean: bool = False) -> LossContext:
    """What the step enters around each micro-batch's forward and backward: when the logits are sharded by
    vocabulary (``enabled``), the lean cross-entropy for a loss that comes through ``F.cross_entropy``
    (``vocab_loss``), torch's ``loss_parallel`` for any other op on the split logits; else, for a plan whose loss
    runs lean (``RunPlan.lean_loss``), the lean cross-entropy on the whole logits; else nothing."""
    if enabled:
        return _split_loss
    return partial(fused_loss, whole=True) if lean else contextlib.nullcontext


@contextlib.contextmanager
def _split_loss() -> Iterator[None]:
    with loss_parallel(), fused_loss():
        yield


__all__ = ["LossContext", "apply_vocab_parallel", "check_vocab", "loss_context", "vocab_entry", "vocab_styles"]
