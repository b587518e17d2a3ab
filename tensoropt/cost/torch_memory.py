"""What FSDP2 (the torch engine's ZeRO 1-3, ``runtime.parallel.data_parallel``) holds beyond the sharded model states.

``cost.model`` divides weights, gradients and optimizer states over dp by ZeRO stage (Rajbhandari et al.,
SC'20). Under ZeRO 3 FSDP2 also holds, at the peak of the backward (torch ``distributed/fsdp/_fully_shard``,
as the fake-tensor simulation of the step shows, ``runtime.memory.check``):

- the root unit's parameters (the ops outside the block copies: embedding, final norm, head) gathered from its
  forward to the end of the backward: the root does not reshard after forward, as its parameters are needed
  again first in the backward (``FSDPState._lazy_init``: ``post_forward_mesh_info = None`` for the root);
- the unit whose backward runs, gathered (``FSDPParamGroup.pre_backward`` unshards it), and the flat all-gather
  output of the unit prefetched after it (``_backward_prefetch``: one unit ahead), which lives until that unit's
  copy-out;
- the reduce-scatter input of the previous unit's gradients (``foreach_reduce``'s flat buffer in the reduce
  dtype, kept until the next unit's ``post_backward`` reclaims it:
  ``reduce_scatter_max_input_buffers`` = 1), beside the current unit's unsharded gradients as autograd made
  them (the gradient dtype).

So ZeRO 3 holds ``gathered`` bytes of the root and one unit as parameters, and one unit's gathered bytes and two
units' gradients (one in the gathered dtype, one in the reduce dtype) as working set, and under ZeRO 2-3 the
root's unsharded gradients that the loss's backward makes (the final norm's and head's), reduced only in the
root's post-backward at the end of the backward. ZeRO 1 and 2 keep every unit gathered through the step (``weight`` is
whole already) and reduce whole gradients (``grad`` whole under ZeRO 1; ZeRO 2's reduce-scatter input is one
unit's, in the working set as under ZeRO 3).

The loss's backward, at the start of every backward, works in float32 on tensors the size of the logits, beside all
the activations kept. torch's ``cross_entropy``: ``log_softmax_backward_data`` and ``nll_loss_backward`` make
float32 logit-sized gradients, two live at once with the vocabulary replicated; under the vocabulary-parallel loss,
torch's ``loss_parallel`` (its ``_nll_loss_and_log_softmax_backward``) makes three of the rank's share. The runtime's
own (``runtime.parallel.vocab_loss``, the layout of Megatron-LM's ``vocab_parallel_cross_entropy``, which Megatron-LM
runs at every tensor-parallel size, one included) runs, in every engine, a loss that comes through
``F.cross_entropy`` on rows of logits, split or whole (``VocabLayout.fused_loss``): it turns the saved softmax into
the gradient in place and makes only its cast to the logits' dtype (none for float32 logits), so the loss's peak is
its forward's: the logits as the head makes them and the float32 copy the loss reads (the model's upcast), beside
the saved softmax. ``loss_gradient_bytes`` prices the larger of the two moments.

With one micro-batch (the optimizer's ``zero_grad`` leaves no gradient before the backward) FSDP2's gradient
shards grow as the copies' activations are freed, so the backward's peak is at one of its ends, not their sum
(``fsdp_held_bytes``). So do the gradients of a plan with no data-parallel wrapper (ZeRO 0 on one replica, tensor
parallelism alone: ``runtime.engines.torch_engine`` wraps nothing, so each ``.grad`` is the one autograd makes); only
DDP allocates its gradient buckets with the wrapper and keeps them.
"""

from __future__ import annotations

import numpy as np

from ..space.plan import LayerStrategy


def largest_copy_parameters(model, tp: int, tp_branches: tuple[str, ...], ep: int = 1) -> float:
    """Elements of the largest block copy's parameters on one device (after tensor parallelism, its experts / ep
    under expert parallelism, whose FSDP2 unit gathers a rank's experts over the dp / ep ranks holding them beside the
    block's unit over dp): one FSDP2 unit (``model`` a ``cost.model.ModelCost``)."""
    return max((cost.layer(LayerStrategy(), tp, tp_branches, 1, 1, ep).parameters for _, cost in model.blocks),
               default=0.0)


def one_copy_peak_bytes(model, tp: int, tp_branches: tuple[str, ...], micro_batch: int, cp: int = 1) -> float:
    """The most one block copy holds of its own in its backward on one device: its kept activations and what it
    recomputes, at most its input checkpoint and every tensor its forward saves (full recomputation; no
    recomputation keeps those tensors, selective keeps some and recomputes the rest, and sequence parallelism
    keeps less of them): the working set at the end of a one-micro-batch backward (``fsdp_held_bytes``), when the
    first copy's backward runs whatever its strategy."""
    return max((c.activation_bytes + c.transient_bytes for _, cost in model.blocks
                for c in (cost.layer(LayerStrategy("full"), tp, tp_branches, micro_batch, cp),)), default=0.0)


FLOAT32 = 4


def logits_elements(model) -> float:
    """Elements of the largest vocabulary-sized tensor the ops outside the blocks make per sample (the logits);
    0 for a model without a vocabulary."""
    vocab = model.vocab.vocab
    ops = model.head_ops + model.middle_ops + model.tail_ops
    return float(max((m.numel for op in ops for m in op.outputs if vocab and m.shape and m.shape[-1] == vocab),
                     default=0))


INT64 = 8
LOSS_SCALARS_BYTES = 2 * FLOAT32      # the loss and ``nll_loss``'s total weight, float32 scalars


def loss_gradient_bytes(model, tp: int, micro_batch: int, logits: float | None = None) -> float:
    """The loss backward's float32 logit-sized gradients (module doc) of one micro-batch on one device, beside
    what the step keeps from its forward outside the graph's activations: the token ids and the targets, int64
    one per token (shifted slices of the batch, which the embedding's and ``cross_entropy``'s flattening may
    copy; ``embedding`` and ``nll_loss`` save them), and the loss's scalars; ``logits``: ``logits_elements(model)``
    when the caller has it (the search prices thousands of contexts)."""
    vocab = model.vocab
    logits = logits_elements(model) if logits is None else logits
    return logits * micro_batch * _loss_gradient_bytes_per_logit(vocab, tp) + \
        lean_forward_extra_bytes(model, micro_batch, logits) + targets_bytes(model, micro_batch, logits)


# the lean loss's vectors of one float or int per token live at its forward's peak (``vocab_loss._SplitCrossEntropy``):
# the row maxima, the per-token sums of exponentials and picked logits (stacked), their log and the loss per token
# (float32: 4 + 8 + 4 + 4), the local targets and gathered columns (int64: 8 + 8), the valid and mine masks (2 bools)
LEAN_LOSS_TOKEN_BYTES = 42


def lean_forward_extra_bytes(model, micro_batch, logits: float) -> float:
    """What the lean loss's moment, its forward's, holds beside the logits while the model's forward still runs: the
    embedding's output and the blocks' output, which nothing saves (the first norm and the final norm save their own
    float32 copies) but the model's frames may hold until they return (``DecoderLM``'s ``x``s; nanoGPT's ``tok_emb``),
    whole (an upper bound under sequence parallelism), and the loss's own per-token vectors; 0 under torch's loss,
    whose peak is its backward's, after the forward's frames are gone."""
    if not (model.vocab.fused_loss and logits):
        return 0.0
    return 2 * model.carried_bytes * micro_batch + LEAN_LOSS_TOKEN_BYTES * (_tokens(model, logits) * micro_batch)


def _loss_gradient_bytes_per_logit(vocab, tp: int) -> float:
    """Bytes per logit of the loss backward's working set beside the saved log-softmax (module doc)."""
    split = vocab.split(tp)
    if vocab.fused_loss:
        # the lean loss, split or whole: its forward's working set, more than its backward's cast: the float32 logits
        # the loss reads, and the head's own logits beside them where those are another dtype (the model's upcast)
        return (FLOAT32 + _cast_bytes_per_logit(vocab)) / (tp if split else 1)
    return 3 * FLOAT32 / tp if split else 2 * FLOAT32


def _cast_bytes_per_logit(vocab) -> int:
    """Bytes per logit of the lean loss's gradient cast to the logits' dtype: none for float32 logits."""
    return vocab.logit_bytes if vocab.logit_bytes != FLOAT32 else 0


def stage_loss_bytes(model, tp: int, micro_batch: int, logits: float | None = None) -> float:
    """The loss's working set on a pipeline's last stage, whose module is a traced graph that frees each value after
    its last use: under the lean loss (split or whole) the head's logits are gone once the model's float32 copy of
    them exists, so its forward holds that copy (``loss_forward_bytes``) and its backward the gradient's cast; any
    other loss as ``loss_gradient_bytes``."""
    vocab = model.vocab
    if not vocab.fused_loss:
        return loss_gradient_bytes(model, tp, micro_batch, logits)
    logits = logits_elements(model) if logits is None else logits
    cast = logits * micro_batch * _cast_bytes_per_logit(vocab) / (tp if vocab.split(tp) else 1)
    return max(loss_forward_bytes(model, tp, micro_batch, logits), cast + targets_bytes(model, micro_batch, logits))


def targets_bytes(model, micro_batch, logits: float | None = None):
    """The token ids and targets (int64, one per token) and the loss's scalars of one micro-batch (``micro_batch``
    samples, a number or an array; ``logits``: ``logits_elements(model)`` when the caller has it). The step holds
    them whole (the batch's), so they outlive the loss's backward, where the capture counts the targets among what
    the loss saves."""
    logits = logits_elements(model) if logits is None else logits
    return (2 * _tokens(model, logits) * micro_batch * INT64 + LOSS_SCALARS_BYTES) if logits else 0.0


def _tokens(model, logits: float) -> float:
    """Tokens per sample whose logits are ``logits`` elements (0 for a model without a vocabulary)."""
    return logits / model.vocab.vocab if model.vocab.vocab else 0.0


def loss_forward_bytes(model, tp: int, micro_batch: int, logits: float | None = None) -> float:
    """The loss forward's working set of one micro-batch on one device beside the activations it saves: the float32
    logits ``log_softmax`` reads (the upcast copy of bf16 logits, or the float32 product itself), which nothing
    saves, while its output (saved) is made, a rank's share under the vocabulary-parallel loss; and the token ids and
    targets, as in ``loss_gradient_bytes``. A forward's peak where the engine holds more in the forward than in the
    backward (DeepSpeed ZeRO 3's prefetch: ``cost.deepspeed_memory.zero3_forward_bytes``)."""
    split = model.vocab.split(tp)
    logits = logits_elements(model) if logits is None else logits
    return logits * micro_batch * FLOAT32 / (tp if split else 1) + targets_bytes(model, micro_batch, logits)


def unit_backward_bytes(zero, gathered, grad, unit_params):
    """What FSDP2 holds beside a block copy's backward, in a flat plan and on a pipeline stage alike (arrays, one
    entry per plan): under ZeRO 3 the unit gathered, the next unit's flat all-gather output and two units'
    gradients, under ZeRO 2 the two units' gradients. A unit's gradients are the unsharded one autograd makes, in
    the gathered dtype, and the reduce-scatter's input, in the reduce dtype (``MixedPrecisionPolicy``:
    ``gathered`` and ``grad`` bytes per parameter); ``unit_params``: the largest block copy's elements."""
    unit, grads = gathered * unit_params, (gathered + grad) * unit_params
    return np.where(zero == 3, 2 * unit + grads, np.where(zero == 2, grads, 0.0))


def accumulated_unit_bytes(zero, gathered, reduced, unit_params, micro_batches):
    """What FSDP2 holds beside a block copy's backward under ZeRO 1 while it accumulates micro-batches in a reduce
    dtype other than the gathered one (bf16-mixed: bf16 weights, float32 gradients; arrays, one entry per plan): the
    unit's fresh gradients, in the gathered dtype, all of them until the unit's post-backward. FSDP2 keeps the
    accumulated gradient apart from the parameter's ``.grad`` (``FSDPParam.to_accumulated_grad_if_needed`` casts the
    first micro-batch's into ``unsharded_accumulated_grad`` and sets ``.grad`` to None), so every later micro-batch's
    autograd makes a new ``.grad`` per parameter, and ``FSDPParamGroup.post_backward`` adds them in
    (``accumulate_unsharded_grad_if_needed``) only once the whole unit's backward is done. With the gradients in the
    gathered dtype (``reduced == gathered``) autograd adds each fresh gradient into ``.grad`` in place and frees it
    (``pipeline_memory.copy_backward_bytes``). Found by the simulated rank of an interleaved 1F1B ZeRO 1 plan of
    LLaMA-2 70B, whose peak fell in a copy's backward 0.1% above the prediction without it."""
    zero, gathered, reduced = np.asarray(zero), np.asarray(gathered), np.asarray(reduced)
    return np.where((zero == 1) & (np.asarray(micro_batches) > 1) & (reduced != gathered), gathered * unit_params, 0.0)


def fsdp_held_bytes(zero, gathered, grad, unit_params, root_params, loss_grads, layer_transient, gradients,
                    micro_batches, data_parallel, activations, head_acts, copy_peak, tail_params,
                    largest_parameter=0.0, unbucketed=0.0, copy_op_backward=0.0, tail_acts=0.0,
                    loss_in_forward: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(parameter bytes, gradient bytes, working-set bytes, activation bytes) beside the sharded states at the
    largest of the backward's peaks (module doc); arrays, one entry per plan. ``gathered``/``grad``: bytes per
    parameter as gathered and as reduced; ``unit_params``: the largest block copy's elements; ``root_params``:
    the loose ops' elements on the stage; ``loss_grads``: ``loss_gradient_bytes``; ``layer_transient``: the
    largest working set of one copy's backward (``cost.layer``: recomputed activations); ``gradients``: the
    gradient bytes ZeRO leaves on the device once the step's backward is done; ``activations``: the kept
    activations of the step's micro-batch in flight; ``head_acts``: those of the loose ops before the blocks;
    ``copy_peak``: ``one_copy_peak_bytes``; ``tail_params``: the elements of the loose ops after the blocks;
    ``largest_parameter``: the model's largest parameter's elements; ``unbucketed``: the gradient bytes DDP leaves
    out of its buckets (an expert-parallel rank's experts', reduced over their own ranks:
    ``runtime.parallel.expert_parallel``), held once; ``copy_op_backward``: the gradients the largest op of a copy's
    backward holds at once (``pipeline_memory.copy_backward_bytes``: a gated MLP's product makes two hidden-by-ffn
    gradients from one); ``tail_acts``: the kept activations of the loose ops after the blocks (the final norm's,
    the head's and the loss's saved tensors), which their backward frees before any copy's runs;
    ``loss_in_forward``: the loss's moment is its forward's (the lean loss: ``loss_gradient_bytes``).

    - the loss's backward: its gradients, and under ZeRO 3 the flat all-gather output of the last unit, which
      the root's pre-backward prefetches. The lean loss's moment is in the forward, where under ZeRO 1-3 FSDP2
      still holds the flat all-gather output of the last unit it gathered (its all-gather state, freed by the
      next all-gather or the root's pre-backward): the unit too (under ZeRO 1-2, whose units stay gathered over a
      step's micro-batches, only the first micro-batch's forward gathers, before any gradient exists). FSDP2's
      gradients (ZeRO 1-3) do not exist yet in a step of one micro-batch: the optimizer's ``zero_grad`` sets them
      to None (torch's default) and FSDP2 makes each unit's in its post-backward. DDP's bucket is allocated with
      the wrapper and kept.
    - a block copy's backward: its recomputed activations, its largest op's gradients (without the kept activations
      of the ops after the blocks, which the loss's and head's backward freed, but for the batch's targets:
      ``targets_bytes``), and under ZeRO 3 the unit
      gathered, the next unit's flat all-gather output and two units' gradients (unsharded as autograd makes them,
      in the gathered dtype, and the reduce-scatter input in the reduce dtype: ``MixedPrecisionPolicy``), under
      ZeRO 2 the two units' gradients. Under ZeRO 1-3 the root's gradients made by the loss's backward (the final
      norm's and head's, unsharded, in the gathered dtype) wait for the root's post-backward at the end of the
      backward, beside every copy's. DDP makes a parameter's fresh gradient before it copies it into its bucket (or,
      under ``no_sync``, adds it to ``.grad``), beside all the others: at most the largest parameter's (the embedding's,
      made last, when the activations are freed), priced with each copy's backward. Without a wrapper (ZeRO 0, one
      replica) a copy's backward holds the gradients made so far beyond those of earlier micro-batches: the loss
      backward's (the loose ops after the blocks) and the copy's own.
    - with one micro-batch under ZeRO 1-3, or without a wrapper, the blocks' backward starts with every copy's kept
      activations and no gradient shard, and ends (the first copy's backward) with every gradient shard, the first
      copy's own (``copy_peak``) and the embedding's activations: each copy's backward frees its activations and
      makes its gradient shards, so the peak is at one of the two ends, not their sum. With more micro-batches the
      gradients of the earlier ones are held throughout.
    - DDP with gradient accumulation: the micro-batches before the last run under ``no_sync`` and accumulate
      into ``.grad`` tensors of their own beside the bucket (``gradient_as_bucket_view`` views the bucket only
      once a synchronising backward copies them in), so the gradients are held twice during the last backward.
    The root's gathered parameters (ZeRO 3) are held through all."""
    zero3, ddp = zero == 3, (zero == 0) & (data_parallel > 1)
    unit = gathered * unit_params
    gradients = np.where(ddp & (micro_batches > 1), 2 * gradients - unbucketed, gradients)
    one_micro_batch = ~ddp & (micro_batches == 1)
    grads_at_loss = np.where(one_micro_batch, 0.0, gradients)
    # ZeRO 1-2 under the lean loss: the first micro-batch's forward gathers (the unit, no gradient yet), a later one's
    # holds the earlier micro-batches' gradients and gathers nothing: the larger of the two
    gathering = loss_in_forward & ((zero == 1) | (zero == 2))
    at_loss = loss_grads + np.where(zero3, unit, np.where(gathering, np.maximum(unit - grads_at_loss, 0.0), 0.0))
    unwrapped = np.where(one_micro_batch, grad * (tail_params + unit_params), grad * largest_parameter)
    units = unit_backward_bytes(zero, gathered, grad, unit_params) + \
        accumulated_unit_bytes(zero, gathered, grad, unit_params, micro_batches) + \
        np.where(zero >= 1, gathered * tail_params, 0.0) + \
        np.where(ddp, grad * largest_parameter, np.where(zero == 0, unwrapped, 0.0))
    in_block = layer_transient + copy_op_backward + units
    at_end = head_acts + copy_peak + units
    moments = np.stack([activations + at_loss + grads_at_loss,           # the loss's backward
                        activations - tail_acts + in_block + grads_at_loss,        # the last copy's
                        np.where(one_micro_batch, at_end + gradients, 0.0)])    # the first copy's (one micro-batch)
    which = np.argmax(moments, axis=0)
    pick = lambda *options: np.choose(which, options)  # noqa: E731
    return (np.where(zero3, gathered * root_params, 0.0), pick(grads_at_loss, grads_at_loss, gradients),
            pick(at_loss, in_block, units), pick(activations, activations - tail_acts, head_acts + copy_peak))


__all__ = ["LEAN_LOSS_TOKEN_BYTES", "accumulated_unit_bytes", "fsdp_held_bytes", "largest_copy_parameters",
           "lean_forward_extra_bytes", "logits_elements", "loss_forward_bytes", "loss_gradient_bytes",
           "one_copy_peak_bytes", "stage_loss_bytes", "targets_bytes", "unit_backward_bytes"]
