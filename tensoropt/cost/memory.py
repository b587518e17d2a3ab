"""Peak memory per device of many plans at once (``cost.model.evaluate_rows``'s memory half): the model states
ZeRO leaves on a device, the activations its micro-batches keep in flight, and each engine's own buffers and
working sets at the step's peak. Every engine's terms live in its own module (``cost.torch_memory`` for DDP and
FSDP2, ``cost.deepspeed_memory``, ``cost.pipeline_memory``); this module chooses, per plan, which apply."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .deepspeed_memory import extra_bytes
from .pipeline_memory import (
    fsdp_stage_bytes,
    gradients_divisor,
    in_flight,
    in_flight_last,
    message_bytes,
    relayed_in_flight,
)
from .rows import PlanRows
from .torch_memory import accumulated_unit_bytes, fsdp_held_bytes, targets_bytes

if TYPE_CHECKING:
    from .model import ModelCost


def _only(mask: np.ndarray, outputs: int, term, *args) -> list[np.ndarray]:
    """The ``outputs`` arrays ``term(*args)`` returns, computed on the plans ``mask`` selects (per-plan arrays cut to
    them, numbers as they are) and 0 on the rest: an engine's terms are computed for that engine's plans only."""
    out = [np.zeros(len(mask)) for _ in range(outputs)]
    if mask.any():
        got = term(*(a[mask] if isinstance(a, np.ndarray) and a.shape == mask.shape else a for a in args))
        for o, g in zip(out, got if outputs > 1 else (got,)):
            o[mask] = g
    return out


def activations_bytes(model: ModelCost, r: PlanRows, activation_bytes, transient_bytes, at_loss_bytes=0.0
                      ) -> np.ndarray:
    """The activations a device keeps at its peak: its copies' and loose ops' saved tensors of the micro-batches in
    flight, and a pipeline stage's messages received early (``pipeline_memory.message_bytes``) and loose ops'
    backward working set
    (a stage's loose ops' backward, the loss's first, and its copies' recomputation run at different times:
    ``transient_bytes`` is the copies' backward working set, ``at_loss_bytes`` what FSDP2 holds beside the
    loss's)."""
    carried = model.carried_bytes
    # the last stage runs the loss: its working set (``stage_loss_bytes``: torch's float32 logit-sized gradients,
    # or the lean loss's forward, split or whole) and the loose ops' kept activations (the saved softmax among
    # them) live only around it: the copies' backward, whose working set is ``transient_bytes``, runs after the loose
    # ops' backward freed them (the last stage runs each micro-batch's backward right after its forward). The first
    # stage's embedding backward makes its rows' gradient only (``runtime.parallel.vocab_parallel.VocabEmbedding``)
    back_first = np.maximum(r.first_back - transient_bytes, 0.0)
    back_last = np.maximum(r.last_acts + np.maximum(r.last_back, r.stage_loss) + at_loss_bytes - transient_bytes, 0.0)
    messages_first, messages_last = message_bytes(r.pp, r.v, r.m, r.mb, carried)
    # the tensors the copies read from outside their stream that only a recomputation keeps
    # (``ModelCost.checkpoint_inputs_bytes``, a micro-batch's): priced as held for the step whatever the copies'
    # recomputation, since a plan's per-copy sums (the search's) cannot say whether it recomputes any: an upper bound by
    # their size for a plan that recomputes none, whose forward frees them
    held = model.checkpoint_inputs_bytes * r.mb
    # a stage's received copies of those tensors (all of them, saved or not: a bound), one per chunk in flight
    relayed = model.relayed_bytes * r.mb + model.relayed_fixed_bytes
    relayed_first, relayed_last = (n * relayed for n in relayed_in_flight(r.pp, r.m, r.v))
    acts_first = in_flight(r.pp, r.m, r.v) * (activation_bytes + r.first_acts + held) + np.where(
        r.piped, messages_first + back_first + relayed_first, 0.0)
    acts_last = np.where(r.piped, in_flight_last(r.pp, r.m, r.v) * activation_bytes + messages_last + back_last
                         + relayed_last, acts_first)
    return np.maximum(acts_first, acts_last)


def stage_copy_backward_bytes(r: PlanRows) -> np.ndarray:
    """What a pipeline stage's copy backward holds beside its kept and recomputed activations
    (``pipeline_memory.copy_backward_bytes``): the largest op's gradients, with its parameters' fresh gradients
    where the stage accumulates whole ones over micro-batches (ZeRO 0/1; a ZeRO 2/3 stage's fresh gradients are
    FSDP2's unit gradients, ``fsdp_stage_bytes``); 0 without a pipeline."""
    accumulating = (gradients_divisor(r.pp, r.zero, r.dp) == 1) & (r.m > 1)
    # FSDP2's ZeRO 1 stage accumulating in float32 holds a whole unit's fresh bf16 gradients instead
    unit_fresh = r.copy_back + np.where(r.deepspeed, 0.0,
                                        accumulated_unit_bytes(r.zero, r.gathered, r.reduced, r.unit_params, r.m))
    return np.where(r.piped, np.where(accumulating, np.maximum(r.copy_back_fresh, unit_fresh), r.copy_back), 0.0)


def stage_reduction_bytes(r: PlanRows) -> np.ndarray:
    """What FSDP2 holds beside the whole gradients while a torch ZeRO 1 pipeline stage reduces them, in its last
    micro-batch's backward (0 for other plans): each unit's post-backward copies its accumulated gradients into the
    reduce-scatter's flat input and makes the output shard, in the reduce dtype (``foreach_reduce``), one unit at a
    time. It comes when the step's activations are nearly all freed, so it is a moment of its own beside the copies'
    backward working set (``memory_rows`` takes the larger); the simulated stage of a small model with full
    recomputation peaks there (tests/test_memory_bound.py)."""
    torch_zero1 = r.piped & ~r.deepspeed & (r.zero == 1)
    return np.where(torch_zero1, r.reduced * r.unit_params * (1 + 1 / r.dp), 0.0)


def dp_sharded_elements(model: ModelCost, r: PlanRows, params) -> np.ndarray:
    """The elements whose states ZeRO divides by dp, from ``params``, the elements a rank holds: under expert
    parallelism a rank holds experts / ep of the expert weights, and ZeRO shards those over the dp / ep ranks holding
    the same experts: experts / ep / (dp / ep) = the whole model's / dp, as without expert parallelism."""
    return params + model.expert_parameters * (1 - 1 / r.ep)


def uncast_parameter_elements(ops, indices, dtypes: dict[str, str]) -> float:
    """Elements of the parameters the ops at ``indices`` read that no op of ``ops`` reads in another dtype than the
    parameter's own (``dtypes``: name -> dtype): under autocast the capture records a product reading its weight's
    16-bit copy as reading the parameter in 16 bits (``graph.capture``), so a parameter read only in its own dtype
    has no copy."""
    read = {(r.name, meta.dtype) for op in ops for meta, r in zip(op.inputs, op.sources) if r.kind == "param"}
    cast = {name for name, dtype in read if dtype != dtypes.get(name, dtype)}
    seen: dict[str, int] = {}
    for i in indices:
        for meta, r in zip(ops[i].inputs, ops[i].sources):
            if r.kind == "param" and r.name not in cast:
                seen.setdefault(r.name, meta.numel)
    return float(sum(seen.values()))


def memory_rows(model: ModelCost, r: PlanRows, activation_bytes, transient_bytes, params: np.ndarray
                ) -> dict[str, np.ndarray]:
    """Peak bytes per device and its parts (``parameters``, ``gradients``, ``optimizer``, ``activations``,
    ``other``) of each plan; ``params``: the elements of the device's stage (copies and loose ops)."""
    prof = model.cluster.profile
    activation_bytes, transient = np.asarray(activation_bytes, dtype=float), np.asarray(transient_bytes, dtype=float)
    sharded = dp_sharded_elements(model, r, params)
    weights = r.weight * np.where(r.zero == 3, sharded / r.dp, params)
    divisor = gradients_divisor(r.pp, r.zero, r.dp)
    grads = r.grad * np.where(divisor > 1, sharded, params) / divisor
    # a DDP stage (ZeRO 0) runs its micro-batches' backwards under ``no_sync`` but the last: they accumulate into
    # ``.grad`` tensors of their own beside the bucket DDP allocated with the wrapper, as the whole model does
    # (``cost.torch_memory.fsdp_held_bytes``); the executor tells the stage so (``runtime.pipeline.executor``)
    grads = grads * np.where(r.piped & ~r.deepspeed & (r.zero == 0) & (r.m > 1) & (r.dp > 1), 2, 1)
    optimizer = np.where(r.offload, 0.0, r.optimizer_bytes * np.where(r.zero >= 1, sharded / r.dp, params))
    # FSDP2's and DDP's terms are the torch engine's flat plans'. A pipeline stage prices the loss's backward with
    # its loose ops (``activations_bytes``); on a ZeRO 2/3 stage FSDP2's units run every micro-batch as in a flat
    # plan, and what they hold beside the loss's backward and beside a copy's is ``pipeline_memory``'s
    staged = r.piped & ~r.deepspeed & (r.zero >= 2)
    stage_params, at_loss, in_copy = _only(staged, 3, fsdp_stage_bytes, r.zero, r.gathered, r.reduced, r.unit_params,
                                           r.loose_params)
    stage_working = transient + in_copy + stage_copy_backward_bytes(r)
    activations = activations_bytes(model, r, activation_bytes, np.where(r.piped, stage_working, transient), at_loss)
    flat_torch = ~r.deepspeed & ~r.piped
    held_params, torch_grads, torch_working, torch_acts = _only(
        flat_torch, 4, fsdp_held_bytes, r.zero, r.gathered, r.reduced, r.unit_params, r.loose_params, r.loss_grads,
        transient, grads, r.m, r.dp, activations,
        r.head_acts + model.checkpoint_inputs_bytes * r.mb, r.copy_peak, r.tail_params, model.largest_parameter,
        r.grad * np.where(r.ep > 1, model.expert_parameters / r.ep, 0.0), r.copy_back,
        np.maximum(r.first_acts - r.head_acts - targets_bytes(model, r.mb / r.cp), 0.0), model.vocab.fused_loss)
    grads, activations = np.where(flat_torch, torch_grads, grads), np.where(flat_torch, torch_acts, activations)
    # a ZeRO 1 stage's reduction, in its last micro-batch's backward: that micro-batch's activations (and the
    # embedding's), its largest op's gradients and FSDP2's reduction buffers, beside the whole gradients
    reduction = stage_reduction_bytes(r)
    reduction_moment = np.where(reduction > 0, reduction + r.copy_back + activation_bytes + r.first_acts
                                + model.checkpoint_inputs_bytes * r.mb, 0.0)
    working = np.where(flat_torch, torch_working,
                       np.where(r.piped, np.maximum(stage_working, reduction_moment - activations),
                                np.maximum(transient, r.loss_grads)))
    held_params = held_params + stage_params
    deepspeed_bytes, = _only(r.deepspeed, 1, extra_bytes, r.zero, r.offload, params, r.dp, r.weight, r.grad,
                             r.master, r.moment, r.partition_copy, grads, activations, model.largest_parameter,
                             transient, np.where(r.piped, 0.0, r.loss_grads), model.largest_tied_parameter,
                             np.where(r.piped, 0.0, r.loss_forward))
    # autocast's 16-bit copies of the float32 weights (``cost.states.torch_mixed``, ZeRO 0): of the weights its
    # products read, so not of the experts' that Hugging Face's grouped experts read through ``_grouped_mm``, which no
    # autocast op list casts (torch's dispatcher has no Autocast kernel for it): they compute in float32 and nothing
    # holds a 16-bit copy of them (``ModelCost.uncast_expert_parameters``); a rank holds experts / ep of them. A
    # pipeline stage's share of them is not in these rows (stages may hold unequal expert layers: DeepSeek-V3's first
    # layers are dense), so a pipelined plan keeps their copies priced: an upper bound
    cast = r.cast_copy * (params - np.where(r.pp > 1, 0.0, model.uncast_expert_parameters / r.ep))
    # the gathered copies FSDP2 holds are working memory (``other``); ``parameters_bytes`` stays the model states
    other = working + held_params + prof.runtime_overhead_bytes + cast + model.buffer_bytes + deepspeed_bytes
    return {"peak_memory_bytes": weights + grads + optimizer + activations + other, "parameters_bytes": weights,
            "gradients_bytes": grads, "optimizer_bytes": optimizer, "activations_bytes": activations,
            "other_bytes": other}


__all__ = ["activations_bytes", "dp_sharded_elements", "memory_rows", "stage_copy_backward_bytes",
           "stage_reduction_bytes", "uncast_parameter_elements"]
