"""The numbers of many plans' contexts as per-plan arrays: what ``cost.model.evaluate_rows`` prices the search's
candidates from, element by element, so that each plan gets the very floats it would get priced alone."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from .deepspeed_memory import master_and_moment_bytes
from .pipeline_memory import copy_backward_bytes
from .states import state_bytes
from .torch_memory import (
    largest_copy_parameters,
    logits_elements,
    loss_forward_bytes,
    loss_gradient_bytes,
    one_copy_peak_bytes,
    stage_loss_bytes,
)

if TYPE_CHECKING:
    from .model import Context, ModelCost


@dataclass(frozen=True)
class PlanRows:
    """One array entry per plan: its context's choices, its model-state bytes per parameter (``cost.states``) and
    the sizes of its stage's ops outside the blocks."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    v: np.ndarray                  # interleaved stages per device
    m: np.ndarray                  # micro-batches per step
    mb: np.ndarray                 # samples per micro-batch
    zero: np.ndarray
    offload: np.ndarray            # bool
    weight: np.ndarray             # bytes per parameter (``StateBytes``)
    gathered: np.ndarray
    grad: np.ndarray
    adam_moved: np.ndarray
    optimizer_bytes: np.ndarray
    cast_copy: np.ndarray
    deepspeed: np.ndarray          # bool: DeepSpeed's engine, with its own buffers (``cost.deepspeed_memory``)
    master: np.ndarray
    moment: np.ndarray
    partition_copy: np.ndarray
    reduced: np.ndarray            # bytes per gradient element reduced over dp (``StateBytes.reduced_bytes``)
    loose_time_s: np.ndarray       # the slower of the first and last stage's ops outside blocks
    loose_params: np.ndarray       # elements, the larger stage's
    first_acts: np.ndarray         # the first stage's loose ops' kept activations, bytes
    last_acts: np.ndarray
    first_back: np.ndarray         # their backward's working set, bytes
    last_back: np.ndarray
    unit_params: np.ndarray        # elements of the largest block copy on one device (one FSDP2 unit)
    loss_grads: np.ndarray         # the loss backward's float32 logit-sized gradients, bytes
    loss_forward: np.ndarray       # the loss forward's float32 logits beside what it saves, bytes
    stage_loss: np.ndarray         # the loss's working set on a pipeline's last stage (``stage_loss_bytes``), bytes
    copy_peak: np.ndarray          # the most one block copy keeps and recomputes in its backward, bytes
    head_acts: np.ndarray          # kept activations of the loose ops before the blocks (the embedding's), bytes
    tail_params: np.ndarray        # elements of the loose ops after the blocks (the final norm and head)
    copy_back: np.ndarray          # the largest op backward's gradients in a block copy, bytes (``pipeline_memory``)
    copy_back_fresh: np.ndarray    # the same with its parameters' fresh gradients (accumulating micro-batches)

    @property
    def piped(self) -> np.ndarray:
        return self.pp > 1


_INTS = 19          # the first 19 fields are integers, the rest floats


def plan_rows(model: ModelCost, ctxs: list[Context], which: np.ndarray) -> PlanRows:
    """The arrays of plan i under context ``ctxs[which[i]]`` (each context's numbers computed once)."""
    ints, floats = [], []
    logits = logits_elements(model)
    # what many contexts share, computed once: per (tp, branches), per (tp, branches, micro-batch), per precision
    largest_copy: dict = {}
    copy_peak: dict = {}
    loss_bytes: dict = {}             # (backward, forward) working sets of the loss per micro-batch key
    states: dict = {}
    copy_back: dict = {}              # the copy's largest op backward per (tp, branches, micro-batch, gradient bytes)
    per_shape: dict = {}              # the floats of every context of one (tp, branches, micro-batch, pp, grad bytes)
    for c in ctxs:
        tp_key, mb_key = (c.tp, c.tp_branches), (c.tp, c.tp_branches, c.micro_batch)
        state_key = (c.dtype, c.master_weights, c.precision, c.zero, c.engine, c.grad_dtype)
        if state_key not in states:
            state = state_bytes(c.dtype, c.master_weights, c.precision, c.zero, c.grad_dtype)
            cast = model.autocast_copy_bytes if state.cast_copy is None else state.cast_copy
            states[state_key] = state.grad, (
                state.weight, state.gathered_bytes, state.grad, state.adam_moved, state.optimizer_bytes(c.zero), cast,
                c.engine == "deepspeed", *master_and_moment_bytes(state.optimizer, state.partition_copy),
                state.partition_copy, state.reduced_bytes)
        grad_bytes, state_ints = states[state_key]
        shape = (*mb_key, c.pp, grad_bytes)
        if shape not in per_shape:
            if tp_key not in largest_copy:
                largest_copy[tp_key] = largest_copy_parameters(model, c.tp, c.tp_branches)
            if mb_key not in copy_peak:
                copy_peak[mb_key] = one_copy_peak_bytes(model, c.tp, c.tp_branches, c.micro_batch)
                loss_bytes[mb_key] = (loss_gradient_bytes(model, c.tp, c.micro_batch, logits),
                                      loss_forward_bytes(model, c.tp, c.micro_batch, logits),
                                      stage_loss_bytes(model, c.tp, c.micro_batch, logits))
            first, last = model.loose(c.tp, c.micro_batch, c.pp)
            head, tail = model.loose(c.tp, c.micro_batch, 2)     # the ops before the blocks, and after them
            back_key = (*mb_key, grad_bytes)
            if back_key not in copy_back:
                copy_back[back_key] = copy_backward_bytes(model, *back_key)
            per_shape[shape] = (max(first.time_s, last.time_s), max(first.parameters, last.parameters),
                                first.activation_bytes, last.activation_bytes, first.backward_bytes,
                                last.backward_bytes, largest_copy[tp_key], *loss_bytes[mb_key], copy_peak[mb_key],
                                head.activation_bytes, tail.parameters, *copy_back[back_key])
        ints.append((c.dp, c.tp, c.pp, c.virtual_stages, c.micro_batches, c.micro_batch, c.zero, c.offload,
                     *state_ints))
        floats.append(per_shape[shape])
    columns = [*np.array(ints, dtype=np.int64)[which].T, *np.array(floats, dtype=float)[which].T]
    names = [f.name for f in fields(PlanRows)]
    assert len(names) == len(columns) and len(ints[0]) == _INTS
    values = dict(zip(names, columns))
    values["offload"], values["deepspeed"] = values["offload"].astype(bool), values["deepspeed"].astype(bool)
    return PlanRows(**values)


__all__ = ["PlanRows", "plan_rows"]
