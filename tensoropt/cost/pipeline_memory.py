"""Memory a pipeline stage holds for its messages, beside the activations its micro-batches save.

``torch.distributed.pipelining`` (torch 2.13, ``stage.py``) allocates its receive buffers once, when a stage is
set up for a step count of ``m`` micro-batches, and keeps them for the run:

- a stage that is not the first gets one buffer per input per micro-batch (``PipelineStage.
  _setup_forward_recv_info``: ``_make_tensor_from_meta`` for every ``chunk_id in range(num_microbatches)``);
- a stage that is not the last gets one gradient buffer per output that requires a gradient per micro-batch
  (``_PipelineStageBase._setup_backward_recv_info`` -> ``PipelineStage._create_grad_recv_info``).

The stream between stages is the block's carried state (``space.block.BlockSpace.carried_bytes`` per sample),
sent whole even under tensor parallelism (``runtime.pipeline_tp``: sequence parallelism gathers the stream before
a stage hands it on), so each buffer holds ``micro_batch * carried_bytes``. With ``v`` interleaved stages a device
holds stages ``r, r + p, ...``: stage 0 (device 0) is first and not last, every other stage of device 0 is neither,
and device ``p - 1`` holds the last stage and ``v - 1`` others that are not first; either way ``2 v - 1`` buffer
sets of ``m`` micro-batches. Values a stage only relays (an attention mask made once, integer and without
gradient) are not counted.

Beside the buffers, a stage keeps what it sent (``held_*_bytes``):
- each forward's outputs stay in the stage's ``fwd_cache`` until that micro-batch's backward (``stage.py
  forward_one_chunk``: ``self.fwd_cache[fwd_chunk_id] = (output_tuple, ...)``, for ``backward_one_chunk``); no op of
  the stage saves its last copy's output, so the layers' saved bytes do not count it;
- a send's work holds its tensor until the schedule drops the work (gloo's send work owns its tensor; NCCL's
  stashes it for the caching allocator): ``Schedule1F1B`` keeps one send pending at a time, ``ScheduleGPipe``
  (fewer micro-batches than stages) a whole phase's, and the interleaved schedule every send of the step until
  its end (``schedules._PipelineScheduleRuntime._step_microbatches``: ``send_ops``, waited after the last
  action), so there device 0's ``v`` stages' outputs and its ``v - 1`` later stages' input gradients, and the
  last device's ``v - 1`` outputs and ``v`` input gradients, all stay: ``(2v - 1) m`` messages either way.
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


def embedding_table_elements(ops) -> float:
    """Elements of the largest table an embedding op among ``ops`` reads (the stage's token embedding), whole: the
    size of its gradient before any split (``table_gradient_elements``); 0 where no embedding is among them."""
    return float(max((m.numel for op in ops if op.kind == "embedding"
                      for m, r in zip(op.inputs, op.sources) if r.kind == "param"), default=0))


def table_gradient_elements(pp: int, vocab_split: bool, table_elements: float) -> float:
    """Elements of the table gradient the first stage's embedding backward holds beside its working set, with the
    next micro-batch's activations in flight (1F1B), under the vocabulary-parallel split: DTensor's embedding
    backward has no rule that shards the weight's gradient by vocabulary (``torch/distributed/tensor/_ops/
    _embedding_ops.py``: Partial or Shard(1)), so each rank makes the whole table's gradient and reduces it to its
    shard afterwards (simulated: a 1.05 GB Llama-3-8B table gradient on a tp2 rank, at stage 0's peak). Without the
    split the gradient is the rank's own, counted with the states: the simulated stages show no fresh table gradient
    at their peak (priced so, an 8-layer 32-true pp2 stage read +6.6%). 0 without pipeline stages: a flat plan's
    embedding backward runs last, once the activations are freed."""
    return table_elements if pp > 1 and vocab_split else 0.0


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


def p2p_buffer_bytes(pp, virtual_stages, micro_batches, micro_batch, carried_bytes: float):
    """Bytes of the receive buffers of pipeline device 0 (and of device ``p - 1``: the same count), numbers or
    per-plan arrays; 0 without a pipeline (module doc)."""
    pp, v = np.asarray(pp), np.asarray(virtual_stages)
    buffer_sets = 2 * v - 1
    return np.where(pp > 1, buffer_sets * np.asarray(micro_batches) * np.asarray(micro_batch) * carried_bytes, 0.0)


def gradients_divisor(pp, zero, dp):
    """What a device's gradients are divided by: ZeRO 2 and 3 keep a shard (``dp``), in a pipeline stage too; ZeRO
    0 and 1 keep them whole. The torch engine makes a ZeRO 2/3 stage's copies and stage module FSDP2 units inside
    the relay, which is no ``FSDPModule`` itself (``runtime.data_parallel.data_parallel_stage``), so the pipeline
    stage does not defer their reduction (``stage.py backward_maybe_with_nosync`` does for an ``FSDPModule``
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


def in_flight(pp, micro_batches, virtual_stages):
    """Micro-batches of activations stage 0 holds at its peak (numbers or arrays of them)."""
    base = np.minimum(micro_batches, pp) * 1.0
    interleaved = base * (1 + (pp - 1) / (pp * virtual_stages))
    return np.where(pp == 1, 1.0, np.where(virtual_stages > 1, interleaved, base))


def in_flight_last(pp, micro_batches, virtual_stages):
    """Micro-batches of activations (in units of the device's copies) the last pipeline device holds at its peak:
    one in 1F1B (its stage runs each micro-batch's backward right after its forward); with ``v`` interleaved
    stages it warms up ``(v - 1) p`` chunks of its earlier stages before its first backward, and runs one more
    forward (``schedules._get_warmup_ops`` for rank ``p - 1``: ``(n_local_stages - 1) * microbatches_per_round``),
    each chunk ``1 / v`` of its copies. The first device's count is ``in_flight``."""
    pp, v, m = np.asarray(pp), np.asarray(virtual_stages), np.asarray(micro_batches)
    chunks = np.minimum((v - 1) * pp + 1, m * v)
    return np.where(v > 1, chunks / v, 1.0)


def held_first_bytes(pp, virtual_stages, micro_batches, micro_batch, carried_bytes: float):
    """Sent messages device 0 still holds at its peak (module doc): the outputs of its micro-batches in flight
    (``min(m, p)``: 1F1B's warm-up and GPipe's forward phase), or with interleaving every send of the step."""
    pp, v, m = np.asarray(pp), np.asarray(virtual_stages), np.asarray(micro_batches)
    messages = np.where(v > 1, (2 * v - 1) * m, np.minimum(m, pp))
    return np.where(pp > 1, messages * np.asarray(micro_batch) * carried_bytes, 0.0)


def held_last_bytes(pp, virtual_stages, micro_batches, micro_batch, carried_bytes: float):
    """Sent messages the last device still holds (module doc): its input gradients pending in sends, one in 1F1B,
    the backward phase's ``m`` in GPipe, or with interleaving every send of the step."""
    pp, v, m = np.asarray(pp), np.asarray(virtual_stages), np.asarray(micro_batches)
    messages = np.where(v > 1, (2 * v - 1) * m, np.where(m >= pp, 1, m))
    return np.where(pp > 1, messages * np.asarray(micro_batch) * carried_bytes, 0.0)


__all__ = ["backward_working_bytes", "copy_backward_bytes", "fsdp_stage_bytes", "gradients_divisor",
           "held_first_bytes", "held_last_bytes", "in_flight", "in_flight_last", "p2p_buffer_bytes"]
