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
    from .context import ContextTable
    from .model import ModelCost


@dataclass(frozen=True)
class PlanRows:
    """One array entry per plan: its context's choices, its model-state bytes per parameter (``cost.states``) and
    the sizes of its stage's ops outside the blocks."""

    dp: np.ndarray                 # ranks the model states divide over and gradients reduce over: dp x cp
    tp: np.ndarray
    pp: np.ndarray
    v: np.ndarray                  # interleaved stages per device
    m: np.ndarray                  # micro-batches per step
    mb: np.ndarray                 # samples per micro-batch (whole samples: a context-parallel rank holds 1/cp of each)
    cp: np.ndarray                 # context-parallel degree
    ep: np.ndarray                 # expert-parallel degree (the experts sharded over ep of the dp ranks)
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


_INTS = 21          # the first 21 fields are integers, the rest floats


def plan_rows(model: ModelCost, table: ContextTable, which: np.ndarray) -> PlanRows:
    """The arrays of plan i under context row ``which[i]`` of ``table``. What many contexts share is computed once
    per distinct value and spread over the rows by indexing: the model states per (kind, ZeRO stage), the loose
    ops' and the loss's sizes per (tp, branches, micro-batch, cp, pipelined or not, gradient bytes). Under context
    parallelism (``cp`` > 1) data parallelism runs over the dp x cp ranks (DDP over all of them, FSDP2 on the
    flattened dp x cp mesh: ``runtime.parallel.context_parallel``), so ``dp`` is dp x cp, while the micro-batches per
    step are the global batch over dp x micro-batch (a context-parallel group shares its samples)."""
    used, at = np.unique(np.asarray(which, dtype=np.int64), return_inverse=True)    # the contexts priced
    kind, zero, tp, mb = table.kind[used], table.zero[used], table.tp[used], table.micro_batch[used]
    branches, pp, dp, cp = table.branches[used], table.pp[used], table.dp[used], table.cp[used]
    state_keys, state_at = np.unique(kind * 4 + zero, return_inverse=True)         # ZeRO stages 0-3
    grads, state_ints = zip(*(_state(model, table.kinds[key // 4], key % 4) for key in state_keys.tolist()))
    grad_bytes = np.array(grads, dtype=np.int64)[state_at]
    # (tp, branches, micro-batch, cp, pipelined, gradient bytes) packed into one integer: each field well inside its
    # bits
    packed = ((((tp * 4096 + branches) * 2**20 + mb) * 256 + cp) * 2 + (pp > 1)) * 256 + grad_bytes
    _, firsts, shape_at = np.unique(packed, return_index=True, return_inverse=True)  # a row of each shape
    floats = [_shape(model, int(tp[r]), table.branch_sets[int(branches[r])], int(mb[r]), int(pp[r]),
                     int(grad_bytes[r]), model.row_cache, int(cp[r])) for r in firsts.tolist()]
    global_batch = np.array([k[0] for k in table.kinds], dtype=np.int64)[kind]
    ints = np.column_stack([dp * cp, tp, pp, table.virtual_stages[used], global_batch // (dp * mb), mb, cp,
                            table.ep[used], zero, table.offload[used], np.array(state_ints, dtype=np.int64)[state_at]])
    columns = [*ints[at].T, *np.array(floats, dtype=float)[shape_at][at].T]
    names = [f.name for f in fields(PlanRows)]
    assert len(names) == len(columns) and ints.shape[1] == _INTS
    values = dict(zip(names, columns))
    values["offload"], values["deepspeed"] = values["offload"].astype(bool), values["deepspeed"].astype(bool)
    ep = table.ep[used]
    if (ep > 1).any():          # a copy's FSDP2 unit holds its experts / ep (``largest_copy_parameters``)
        triple = (tp * 4096 + branches) * 2**20 + ep
        _, firsts, triple_at = np.unique(triple, return_index=True, return_inverse=True)
        units = np.array([_unit_params(model, int(tp[r]), table.branch_sets[int(branches[r])], int(ep[r]))
                          for r in firsts.tolist()])
        values["unit_params"] = units[triple_at][at]
    return PlanRows(**values)


def _unit_params(model: ModelCost, tp: int, branches: tuple[str, ...], ep: int) -> float:
    """``largest_copy_parameters``, kept in the model's ``row_cache``."""
    key = ("copy", tp, branches, ep)
    if key not in model.row_cache:
        model.row_cache[key] = largest_copy_parameters(model, tp, branches, ep)
    return model.row_cache[key]


def _state(model: ModelCost, kind: tuple, zero: int) -> tuple[int, tuple]:
    """(gradient bytes, the state's integer columns) of a context kind under ZeRO stage ``zero``."""
    _, dtype, master_weights, precision, _, engine, grad_dtype = kind
    state = state_bytes(dtype, master_weights, precision, zero, grad_dtype)
    cast = model.autocast_copy_bytes if state.cast_copy is None else state.cast_copy
    return state.grad, (state.weight, state.gathered_bytes, state.grad, state.adam_moved, state.optimizer_bytes(zero),
                        cast, engine == "deepspeed", *master_and_moment_bytes(state.optimizer, state.partition_copy),
                        state.partition_copy, state.reduced_bytes)


def _shape(model: ModelCost, tp: int, branches: tuple[str, ...], mb: int, pp: int, grad_bytes: int, cache: dict,
           cp: int = 1) -> tuple:
    """The float columns of a (tp, branches, micro-batch, cp, pipelined, gradient bytes) shape, kept in ``cache``
    (the model's ``row_cache``: every search and pricing call on the model reads the same shapes) with what shapes
    share (per (tp, branches), per (tp, branches, micro-batch, cp), per gradient bytes too). Under context
    parallelism the ops outside the blocks (embedding, head, loss) run on S / cp tokens of each sample: their sizes
    are those of micro_batch / cp samples."""
    shape_key = ("shape", tp, branches, mb, pp > 1, grad_bytes) + ((cp,) if cp > 1 else ())
    if shape_key in cache:
        return cache[shape_key]
    share = mb / cp if cp > 1 else mb       # samples' worth of tokens a rank computes
    loss_key, back_key = ("loss", tp, branches, mb, cp), ("back", tp, branches, share, grad_bytes)
    if loss_key not in cache:
        logits = logits_elements(model)
        cache[loss_key] = (loss_gradient_bytes(model, tp, share, logits), loss_forward_bytes(model, tp, share, logits),
                           stage_loss_bytes(model, tp, share, logits), one_copy_peak_bytes(model, tp, branches, mb, cp))
    if back_key not in cache:
        cache[back_key] = copy_backward_bytes(model, tp, branches, share, grad_bytes)
    first, last = model.loose(tp, share, pp)
    head, tail = model.loose(tp, share, 2)     # the ops before the blocks, and after them
    cache[shape_key] = (max(first.time_s, last.time_s), max(first.parameters, last.parameters),
                        first.activation_bytes, last.activation_bytes, first.backward_bytes, last.backward_bytes,
                        _unit_params(model, tp, branches, 1), *cache[loss_key], head.activation_bytes, tail.parameters,
                        *cache[back_key])
    return cache[shape_key]


__all__ = ["PlanRows", "plan_rows"]
