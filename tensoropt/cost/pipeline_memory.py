"""Memory a pipeline stage holds for its messages, beside the activations its micro-batches save.

The torch engine runs the schedule ``space.pipeline_schedule`` gives with its own executor
(``runtime.pipeline.executor``), which allocates a receive buffer when its message arrives and waits for every send
at its boundary, and frees the storage of each stage output it has sent (its autograd history stays for the
backward, as Megatron-LM's ``deallocate_output_tensor``). So beside the activations of the micro-batches in
flight (``in_flight``, ``in_flight_last``; a received activation is the stage's input, saved by its first op
like any other activation), a device holds only the messages that arrived before the compute that uses them
(``held_messages``): counted on the schedule itself (``pipeline_schedule.held_messages``, which the tests hold
these closed forms against).

Each message is the block's carried state (``space.block.BlockSpace.carried_bytes`` per sample) of one
micro-batch, or its gradient, which has its shape: priced whole, although between sequence-parallel stages the
runtime sends each rank's ``1 / tp`` share (``runtime.pipeline.tp.sequence_parallel_boundaries``; the price is an
upper bound by the few messages a device holds). What the copies read from outside their stream (an attention
mask, rotary tables) every stage but the first receives too, per micro-batch, and keeps with the stage's
activations until its backward (``relayed_in_flight``).
"""

from __future__ import annotations

import numpy as np

from ..graph.ir import Op
from .torch_memory import unit_backward_bytes


def backward_working_bytes(op: Op) -> float:
    """Gradient bytes one op's backward holds at once: its floating-point outputs' gradients (received) and its
    activation inputs' gradients (produced) at the captured micro-batch (one sample). Autograd's engine runs a
    node's backward with its incoming gradients alive and frees them once the node returns
    (``torch/csrc/autograd/engine.cpp``: ``call_function`` consumes the ``InputBuffer``); parameters' gradients
    are the model state's, counted there. For the head and loss of a language model this is the logits' float32
    gradient next to its input's (``log_softmax_backward``): several times the saved logits themselves."""
    outputs = sum(m.nbytes for m in op.outputs if "float" in m.dtype)
    inputs = sum(m.nbytes for m, r in zip(op.inputs, op.sources) if "float" in m.dtype and r.kind != "param")
    return float(outputs + inputs)


def copy_backward_bytes(model, tp: int, tp_branches: tuple[str, ...], micro_batch: int, grad_bytes: float
                        ) -> tuple[float, float]:
    """(gradients of one op's backward, the same with its parameters' fresh gradients) of the block copy's op that
    holds the most, on one device at ``micro_batch`` samples (``model`` a ``cost.model.ModelCost``; ``grad_bytes``:
    bytes of a parameter's gradient). A stage's peak can fall inside a copy's backward rather than the loss's:
    stage 0, which has no loss, in 1F1B runs each later micro-batch's backward with the earlier ones' outputs in
    flight (``in_flight``) and their gradients accumulated whole under ZeRO 0/1 (``gradients_divisor``). The
    op's backward holds its outputs' gradients and makes its activation inputs' (``backward_working_bytes``: a
    gated MLP's product makes two hidden-by-ffn gradients from one), and for a parameter that has a ``.grad``
    already it makes a fresh gradient that autograd adds in place and then frees (``torch/csrc/autograd/
    functions/accumulate_grad.h``, ``accumulateGrad`` case 2.3: ``variable_grad += new_grad``; only the first
    micro-batch's is stolen as the ``.grad``, case 1.1). The op's shard is as the copy's ops without sequence
    parallelism (a bound: sequence parallelism divides the stream's ops further)."""
    plain = fresh = 0.0
    for _, cost in model.blocks:
        shard = cost.shards(tp, tp_branches, False)
        gradients = cost.backward_bytes * micro_batch / shard
        plain = max(plain, float(gradients.max(initial=0.0)))
        fresh = max(fresh, float((gradients + grad_bytes * cost.params / shard).max(initial=0.0)))
    return plain, fresh


def held_messages(pp, virtual_stages, micro_batches) -> tuple[np.ndarray, np.ndarray]:
    """(messages the first device, messages the last device holds at once beside its activations, at most; numbers
    or per-plan arrays), each a received activation before its forward or a received gradient before its backward.
    The counts ``pipeline_schedule.held_messages`` gives on the simulated clock (a backward twice a forward;
    tests/test_pipeline_schedule.py holds these equal on every p up to 16, v up to 4 and m up to three rounds):

    - 1F1B: the last device receives the next micro-batch's activation while it runs a backward (2 units against
      the previous device's forward of 1), one early; nothing waits on the first.
    - Interleaved (``v > 1``): the last device also gets its later stages' gradients from device 0 while it runs
      its own last stage's backwards, ``floor(p / 3)`` of them at once, at least 1 (``p <= 3``) or 2 once the
      micro-batches fill more than one round (``m > p``); then device 0 too gets gradients early, 1 from ``p = 4``
      and 2 from ``p = 7``."""
    pp, v, m = np.asarray(pp), np.asarray(virtual_stages), np.asarray(micro_batches)
    piped, interleaved, rounds = pp > 1, (v > 1) & (pp > 1), m > pp
    first = np.where(interleaved & rounds, np.where(pp >= 7, 2, np.where(pp >= 4, 1, 0)), 0)
    last_gradients = np.where(rounds, np.maximum(pp // 3, np.where(pp <= 3, 1, 2)), pp // 3)
    last = np.where(piped & ((m > 1) | interleaved), 1, 0) + np.where(interleaved, last_gradients, 0)
    return first, last


def message_bytes(pp, virtual_stages, micro_batches, micro_batch, carried_bytes: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(bytes the first device, bytes the last device holds for messages beside its activations: ``held_messages``
    of ``micro_batch * carried_bytes`` each); 0 without a pipeline."""
    first, last = held_messages(pp, virtual_stages, micro_batches)
    size = np.asarray(micro_batch) * carried_bytes
    return first * size, last * size


def gradients_divisor(pp, zero, dp):
    """What a device's gradients are divided by: ZeRO 2 and 3 keep a shard (``dp``), in a pipeline stage too; ZeRO
    0 and 1 keep them whole. The torch engine makes a ZeRO 2/3 stage's copies and stage module FSDP2 units inside
    the relay, which is no ``FSDPModule`` itself (``runtime.parallel.data_parallel.data_parallel_stage``), so the
    pipeline stage does not defer their reduction (``stage.py backward_maybe_with_nosync`` does for an ``FSDPModule``
    only): FSDP2 reduce-scatters every micro-batch's gradients and accumulates the shards, as the simulated ZeRO 3
    stage shows (only sharded gradients at its peak). Under ZeRO 1 the relay is the FSDP2 root, and the stage
    defers the reduction to its last backward: the micro-batches' gradients accumulate whole."""
    pp, zero, dp = np.asarray(pp), np.asarray(zero), np.asarray(dp)
    return np.where(zero >= 2, dp, 1)


def fsdp_stage_bytes(zero, gathered, grad, unit_params, root_params):
    """(held parameter bytes, extra bytes at the loss's backward, extra bytes during a copy's backward) that FSDP2
    holds on a ZeRO 2/3 pipeline stage beside its sharded states (arrays, one entry per plan; ``gathered`` /
    ``grad``: bytes per parameter; ``unit_params``: the largest copy's elements; ``root_params``: the stage's loose
    ops' elements). The stage's FSDP2 units run their own hooks every micro-batch (``gradients_divisor``), as in
    a flat plan (``cost.torch_memory`` says why each is held): under ZeRO 3 the stage module, the root unit,
    keeps its own (loose ops') parameters gathered from its forward to its backward, and prefetches the last
    copy's all-gather when its backward starts (the loss's backward, on the last stage); a copy's backward holds
    what it holds in a flat plan (``unit_backward_bytes``; under ZeRO 2 the parameters stay gathered: whole
    already). Simulated bf16-mixed ZeRO 2 and 3 stages (``benchmarks/_memory_pipeline.py``) agree."""
    zero, gathered, grad = np.asarray(zero), np.asarray(gathered), np.asarray(grad)
    zero3 = zero == 3
    return (np.where(zero3, gathered * root_params, 0.0), np.where(zero3, gathered * unit_params, 0.0),
            unit_backward_bytes(zero, gathered, grad, unit_params))


def _first_chunks(pp, m, v):
    """Interleaved 1F1B's chunks in flight on device 0 at its peak: its warm-up of ``2 (p - 1) + (v - 1) p`` chunks
    and one more forward (``pipeline_schedule.warmup_forwards``), at most all ``m v``."""
    return np.minimum(2 * (pp - 1) + (v - 1) * pp + 1, m * v)


def _last_chunks(pp, m, v):
    """Interleaved 1F1B's chunks in flight on the last device at its peak: ``(v - 1) p`` warm-up chunks of its
    earlier stages and one more forward (``pipeline_schedule.warmup_forwards`` for rank ``p - 1``), at most ``m v``."""
    return np.minimum((v - 1) * pp + 1, m * v)


def in_flight(pp, micro_batches, virtual_stages):
    """Micro-batches of activations (in units of the device's copies) stage 0 holds at its peak (numbers or
    arrays of them): 1F1B's ``min(m, p)``; with ``v`` interleaved stages its warm-up's chunks and one more forward
    (``_first_chunks``), each ``1 / v`` of its copies: about ``(1 + (p - 1) / (p v))`` times 1F1B's (Narayanan et
    al. 2021, sec. 2.2)."""
    pp, m, v = np.asarray(pp), np.asarray(micro_batches), np.asarray(virtual_stages)
    chunks = _first_chunks(pp, m, v)
    return np.where(pp == 1, 1.0, np.where(v > 1, chunks / np.maximum(v, 1), np.minimum(m, pp) * 1.0))


def relayed_in_flight(pp, micro_batches, virtual_stages) -> tuple[np.ndarray, np.ndarray]:
    """(the first device's, the last device's) stage inputs received beside the stream and held at once (numbers or
    arrays): each stage but the first receives what the copies read from outside their stream (an attention mask,
    rotary tables: ``ModelCost.relayed_bytes`` and ``relayed_fixed_bytes``) into a buffer of its own per
    micro-batch, which the stage's forward keeps for its backward, so a device holds one per chunk of its in flight
    that is not stage 0. Of device 0's F chunks (``_first_chunks``), stage 0's are p per full round of p v forwards
    and min(rest, p) of the rest (the k-th forward runs chunk (k // p) % v); 1F1B's device 0 runs stage 0 alone and
    receives none. Every chunk of the last device receives them (``_last_chunks``; one in 1F1B). The schedule's own
    counts (``pipeline_schedule.compute_order``) agree for every p up to 8, v up to 12 and m up to 8 rounds
    (tests/test_pipeline_schedule.py)."""
    pp, m, v = np.asarray(pp), np.asarray(micro_batches), np.asarray(virtual_stages)
    chunks = _first_chunks(pp, m, v)
    rounds = np.maximum(pp * v, 1)
    stage_0 = (chunks // rounds) * pp + np.minimum(chunks % rounds, pp)
    first = np.where((pp > 1) & (v > 1), chunks - stage_0, 0)
    last = np.where(pp > 1, np.where(v > 1, _last_chunks(pp, m, v), 1), 0)
    return first, last


def in_flight_last(pp, micro_batches, virtual_stages):
    """Micro-batches of activations (in units of the device's copies) the last pipeline device holds at its peak:
    one in 1F1B (its stage runs each micro-batch's backward right after its forward); with ``v`` interleaved
    stages its warm-up's chunks and one more forward (``_last_chunks``), each chunk ``1 / v`` of its copies. The
    first device's count is ``in_flight``."""
    pp, v, m = np.asarray(pp), np.asarray(virtual_stages), np.asarray(micro_batches)
    return np.where(v > 1, _last_chunks(pp, m, v) / v, 1.0)


__all__ = ["backward_working_bytes", "copy_backward_bytes", "fsdp_stage_bytes", "gradients_divisor", "held_messages",
           "in_flight", "in_flight_last", "message_bytes", "relayed_in_flight"]
