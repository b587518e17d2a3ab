"""The cross-entropy on vocabulary-split logits, and on whole ones, with Megatron-LM's footprint.

Under the vocabulary split (``runtime.parallel.vocab_parallel``) each rank holds its ``V/tp`` share of the logits.
torch's ``loss_parallel`` computes the loss right but its backward (``_nll_loss_and_log_softmax_backward``) makes three
float32 shares beside the saved log-softmax: a zeros-like gradient, ``exp`` of the saved output, their sum, then
the product with the output gradient. Megatron-LM's ``vocab_parallel_cross_entropy`` (``tensor_parallel/
cross_entropy.py``) keeps one float32 share, the softmax, and turns it into the logits' gradient in place.

``fused_loss`` does the same here. Within the step's ``loss_context`` the cross-entropy entry point that
``F.cross_entropy`` and ``nn.CrossEntropyLoss`` call (``torch._C._nn.cross_entropy_loss``, looked up on every call)
is routed, for logits that are a DTensor sharded on their class dim over a 1-D mesh, to ``_SplitCrossEntropy``:

- forward: the rows' maxima all-reduced (max), the share shifted by them in float32 (one new share, the logits
  themselves untouched), each token's target logit taken on the rank that holds it, ``exp`` in place, the rows'
  sums and target logits all-reduced (sum) in one call, the share divided in place into the softmax, which is the
  one tensor saved;
- backward: the target entries lowered by one and the rows scaled by the output gradient, in place on the saved
  softmax, which becomes the logits' gradient (cast to the logits' dtype when they are not float32). The saved
  softmax is consumed: a second backward through the same loss is an error, as in Megatron-LM.

Megatron-LM runs the same function at every tensor-parallel size, one included (``compute_language_model_loss``);
torch's ``F.cross_entropy`` on whole logits keeps the same float32 log-softmax but its backward makes two more
logit-sized float32 tensors (``nll_loss_backward``'s gradient, then ``_log_softmax_backward_data``'s). So where the
vocabulary is not split, ``fused_loss(whole=True)`` routes plain 2-D logits to the same function with no process
group (nothing to reduce): every engine's step enters it for a plan whose ``lean_loss`` says the model's loss comes
through the entry point on rows of logits (``space.vocab.VocabLayout.fused_loss``, read from the capture).

Anything else (weights, label smoothing, probabilities as targets, logits of other shapes, whole logits outside
``whole=True``) goes to torch's own entry point, which ``loss_parallel`` handles for split logits. The capture records
whether the model's loss came through this entry point (``graph.capture``: ``cross_entropy_calls``), so the cost model
prices the loss that runs (``cost.torch_memory.loss_gradient_bytes``).
"""

from __future__ import annotations

import contextlib

import torch

from ...graph.loss import wrapped_cross_entropy

MEAN, SUM, NONE = 1, 2, 0           # torch's reduction enum (``torch.nn._reduction``), as the entry point takes it


class _SplitCrossEntropy(torch.autograd.Function):
    """The per-token cross-entropy of a rank's class share (module doc); returns the reduced loss, the same on every
    rank of ``group``; with no group, of whole logits (``first_class`` 0)."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int, group,
                first_class: int) -> torch.Tensor:
        import torch.distributed as dist
        row_max = share.detach().amax(dim=-1).float()
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = share.detach() - row_max.unsqueeze(-1) if share.dtype == torch.float32 else \
            share.detach().float().sub_(row_max.unsqueeze(-1))          # a new share: the logits stay as they are
        valid = target != ignore_index
        local = target - first_class
        mine = valid & (local >= 0) & (local < share.shape[-1])
        column = torch.where(mine, local, 0).unsqueeze(-1)
        picked = shifted.gather(-1, column).squeeze(-1).masked_fill_(~mine, 0.0)
        sums = torch.stack([shifted.exp_().sum(dim=-1), picked])
        if group is not None:
            dist.all_reduce(sums, group=group)
        per_token = (sums[0].log() - sums[1]).masked_fill_(~valid, 0.0)
        softmax = shifted.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, column, mine, valid)
        ctx.reduction, ctx.dtype, ctx.consumed = reduction, share.dtype, False
        if reduction == NONE:
            return per_token
        total = per_token.sum()
        return total / valid.sum() if reduction == MEAN else total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.consumed:
            raise RuntimeError("the vocabulary-parallel cross-entropy's saved softmax was turned into its gradient by "
                               "the first backward: backward through this loss once (no retain_graph)")
        ctx.consumed = True
        softmax, column, mine, valid = ctx.saved_tensors
        softmax.scatter_add_(-1, column, mine.to(softmax.dtype).neg_().unsqueeze(-1))
        if ctx.reduction == NONE:
            scale = grad.float()
        else:
            scale = grad.float() / valid.sum() if ctx.reduction == MEAN else grad.float().expand(valid.shape)
        softmax.mul_(torch.where(valid, scale, 0.0).unsqueeze(-1))
        gradient = softmax if ctx.dtype == torch.float32 else softmax.to(ctx.dtype)
        return gradient, None, None, None, None, None


def _split_mesh(logits):
    """The mesh when ``logits`` is a 2-D DTensor sharded on its class dim over a 1-D mesh; else None."""
    from torch.distributed.tensor import DTensor, Shard
    if not isinstance(logits, DTensor) or logits.ndim != 2 or logits.device_mesh.ndim != 1:
        return None
    placement = logits.placements[0]
    return logits.device_mesh if isinstance(placement, Shard) and placement.dim % 2 == 1 else None


def _whole_target(target):
    """The target as a plain integer tensor (a replicated DTensor's local copy); None for anything else."""
    from torch.distributed.tensor import DTensor, Replicate
    if isinstance(target, DTensor):
        if not all(isinstance(p, Replicate) for p in target.placements):
            return None
        target = target.to_local()
    return target if target.ndim == 1 and not target.is_floating_point() else None


def _whole_logits(logits) -> bool:
    """Whether ``logits`` are whole rows of logits: a floating-point 2-D tensor, not a DTensor (a fake one is whole:
    the memory check runs the step on fake tensors)."""
    from torch.distributed.tensor import DTensor
    return isinstance(logits, torch.Tensor) and not isinstance(logits, DTensor) and logits.ndim == 2 and \
        logits.is_floating_point()


def _routed(original, route_whole: bool):
    """The entry point, running split logits (and with ``route_whole`` whole ones) on ``_SplitCrossEntropy`` and
    everything else on ``original``."""
    def cross_entropy_loss(logits, target, weight=None, reduction=MEAN, ignore_index=-100, label_smoothing=0.0):
        plain = weight is None and not label_smoothing and reduction in (MEAN, SUM, NONE)
        whole = _whole_target(target) if plain and isinstance(target, torch.Tensor) else None
        if whole is not None and route_whole and _whole_logits(logits):
            return _SplitCrossEntropy.apply(logits, whole, ignore_index, reduction, None, 0)
        mesh = _split_mesh(logits) if whole is not None else None
        if mesh is None:
            return original(logits, target, weight, reduction, ignore_index, label_smoothing)
        from torch.distributed.tensor import DTensor, Replicate
        share = logits.to_local()
        loss = _SplitCrossEntropy.apply(share, whole, ignore_index, reduction, mesh.get_group(),
                                        mesh.get_local_rank() * share.shape[-1])
        return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)
    return cross_entropy_loss


def cross_entropy_loss(self, target, weight=None, reduction: int = MEAN, ignore_index: int = -100,
                       label_smoothing: float = 0.0):
    """``aten.cross_entropy_loss`` (its schema's names and defaults: the Python entry point takes every argument)
    through torch's entry point as it is now (routed inside ``fused_loss``): what a pipeline stage's traced graph
    calls in place of the aten op (``runtime.pipeline.tp``), which no Python patch reaches."""
    return torch._C._nn.cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing)


def fused_loss(whole: bool = False) -> contextlib.AbstractContextManager:
    """Route the cross-entropy of vocabulary-split logits, and with ``whole`` of whole ones, to ``_SplitCrossEntropy``
    while inside (module doc)."""
    return wrapped_cross_entropy(lambda original: _routed(original, whole))


__all__ = ["cross_entropy_loss", "fused_loss"]
