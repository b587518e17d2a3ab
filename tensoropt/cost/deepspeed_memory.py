"""DeepSpeed's own buffers, beside the model states ``cost.model`` prices for every engine.

DeepSpeed sizes its communication buffers by config, in elements, not by the model: ZeRO 1-2 allocate each
gradient reduction bucket at ``reduce_bucket_size`` whole when a backward starts (DeepSpeed 0.19
``runtime/zero/stage_1_and_2.py`` ``setup_buckets``: ``torch.empty(reduce_bucket_size)`` per gradient dtype, a
second one under ``overlap_comm``), whatever the model's size. Its defaults (5e8 elements, ``runtime/zero/
config.py``) were chosen for billion-parameter models on GPUs: on a 0.84M-parameter rank they were 2 GB of
float32 buckets. ``bucket_sizes`` caps each such size at the model's parameter count (a bucket never holds more
gradients than the model has), and the runtime writes exactly those sizes into the config it trains with
(``runtime.engines.deepspeed_engine.deepspeed_config``), so the buffers priced here are the ones that run.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

# DeepSpeed 0.19's defaults (runtime/zero/config.py), elements
REDUCE_BUCKET_DEFAULT = 500_000_000
ALLGATHER_BUCKET_DEFAULT = 500_000_000
PREFETCH_BUCKET_DEFAULT = 50_000_000


def overlaps_comm(zero):
    """Whether DeepSpeed reduces gradients on a stream of its own, beside the backward: its default, which
    ``bucket_sizes`` writes (``zero_optimization.overlap_comm``, on under ZeRO 3 only). Below ZeRO 3 the engine
    issues its reductions on the compute stream (``stage_1_and_2.py``: ``reduce_ipg_grads`` and ``average_tensor``
    use ``current_stream()`` without ``overlap_comm``; ZeRO 0 all-reduces after the backward,
    ``engine.allreduce_gradients``), so none of them hides behind compute. Numbers or arrays."""
    return np.asarray(zero) == 3


def bucket_sizes(zero: int, parameters: int | None) -> dict:
    """The ``zero_optimization`` bucket sizes (elements) for a model of ``parameters`` parameters: DeepSpeed's
    defaults capped at the model's size (module doc); None (the size is not known): none written, DeepSpeed's
    defaults apply. ``overlap_comm`` is written as DeepSpeed defaults it (on under ZeRO 3 only), so the number
    of reduce buckets priced (``reduce_buffers``) is the config's."""
    if parameters is None:
        return {}
    cap = max(1, int(parameters))
    sizes = {"reduce_bucket_size": min(REDUCE_BUCKET_DEFAULT, cap),
             "allgather_bucket_size": min(ALLGATHER_BUCKET_DEFAULT, cap), "overlap_comm": bool(overlaps_comm(zero))}
    if zero == 3:
        sizes["stage3_prefetch_bucket_size"] = min(PREFETCH_BUCKET_DEFAULT, cap)
    return sizes


def master_and_moment_bytes(optimizer_bytes: int, partition_copy: int) -> tuple[int, int]:
    """(master weight, AdamW moment) bytes per element from ``cost.states.StateBytes``: mixed precision's K = 12 is
    a float32 master and two float32 moments (no separate ``partition_copy``); training in a dtype of b bytes keeps
    the partition DeepSpeed updates (``partition_copy`` = b) and two moments of b."""
    master = partition_copy or 4
    return master, (optimizer_bytes - (0 if partition_copy else master)) // 2


def reduce_bucket(parameters):
    """Elements of one gradient reduction bucket as ``bucket_sizes`` writes it (numbers or arrays)."""
    return np.minimum(REDUCE_BUCKET_DEFAULT, np.maximum(1, parameters))


def in_backward_bytes(zero, params, grad_bytes, weight_bytes, largest_parameter=0):
    """What DeepSpeed holds during a backward beyond the model states, gradients and activations priced:
    ZeRO 1-2 the reduction bucket ``setup_buckets`` allocates whole (``reduce_bucket_size`` elements in the
    gradients' dtype; one, ``overlap_comm`` being off); ZeRO 3 the same bucket (``stage3.py``: allocated once at
    initialisation) and the gathered weights it keeps for reuse (``zero3_gathered``). ZeRO 3 copies each fresh
    gradient into the bucket in its hook (``__add_grad_to_ipg_bucket``, ``contiguous_gradients``: the fresh one is
    dropped); a bucket reduced before the backward ends (a model larger than the bucket, ``reduce_bucket``) is
    flattened beside it by ``reduce_scatter_coalesced`` (``__avg_scatter_grads``): a second bucket's worth. A
    bucket holding the whole model is reduced once, in the backward's epilogue, when the activations are freed
    (``after_backward_bytes``). ZeRO 0 reduces after the backward (``after_backward_bytes``). ZeRO 1-2 also hold a
    parameter's fresh gradient beside the one accumulated before (autograd's ``AccumulateGrad`` adds the new
    gradient of a tied weight's second use, or of a later micro-batch, into ``.grad`` and then frees it;
    DeepSpeed copies it into the bucket only after the hook): at most the largest parameter's."""
    bucket = reduce_bucket(params) * grad_bytes
    fresh = np.minimum(largest_parameter, params) * grad_bytes
    mid_backward = np.where(params > REDUCE_BUCKET_DEFAULT, bucket, 0.0)
    zero3 = zero3_gathered(params, weight_bytes) + mid_backward
    return np.where(zero == 0, 0.0, bucket + np.where(zero == 3, zero3, fresh))


def largest_tied_parameter(graph) -> int:
    """Elements of the largest parameter that ops read in more than one place (a tied embedding and head): its
    gradient arrives in more than one part (``tied_gradient_bytes``). 0 where none is."""
    readers = Counter(name for op in graph.ops for name in {r.name for r in op.sources if r.kind == "param"})
    return max((meta.numel for name, meta in graph.params if readers.get(name, 0) > 1), default=0)


def tied_gradient_bytes(zero, params, grad_bytes, largest_tied=0):
    """The end of a backward, once the activations and the loss's gradients are freed, for a weight read in two
    places: autograd holds the gradient of its later use (the head's) in the ``AccumulateGrad`` node's input
    buffer until the earlier use's (the embedding's) arrives, sums the two into a new tensor, and only then adds
    the sum into ``.grad`` (``torch/csrc/autograd/input_buffer.cpp``: the second arrival is added out of place):
    three gradients of it beside ``.grad`` at once, and under ZeRO 1-3 beside the reduction bucket (measured: the
    peak of the ZeRO 1 run with full recomputation is the embedding's backward, with 3 x 8 MiB of its gradients).
    Autograd's, not DeepSpeed's: the torch engine's backward holds them too (priced here for DeepSpeed only)."""
    bucket = np.where(zero >= 1, reduce_bucket(params) * grad_bytes, 0.0)
    return bucket + 3 * np.minimum(largest_tied, params) * grad_bytes


def zero3_gathered(params, weight_bytes):
    """The weights ZeRO 3 keeps gathered: ``PartitionedParameterCoordinator`` releases a gathered parameter only
    past ``stage3_max_live_parameters`` (1e9) gathered elements or when its next use is further than
    ``stage3_max_reuse_distance`` (1e9) elements away, so up to min(1e9, parameters) stay gathered."""
    return np.minimum(1e9, params) * weight_bytes


def zero3_forward_bytes(zero, params, grad_bytes, weight_bytes, transient=0.0, loss_gradients=0.0, loss_forward=0.0):
    """ZeRO 3's forward peak beyond the states, activations and working set priced, which can pass its backward's:
    the bucket (allocated at initialisation) and the gathered weights held twice while a prefetch is in use. The
    coordinator prefetches up to ``stage3_prefetch_bucket_size`` elements in one coalesced all-gather
    (``partition_parameters.py`` ``_all_gather_dtype``: one flat output); waiting on it copies every parameter it
    gathered out into a tensor of its own (``AllGatherCoalescedHandle.wait``: ``torch.cat`` of the ranks' parts),
    and the flat lives on with the handle until the last of those parameters is fetched. The forward holds no
    loss gradients yet (priced in the working set beside the backward's activations): of that working set it holds
    a recomputed block's ``transient`` (a checkpointed block's forward makes its activations, then drops them) or
    the loss forward's float32 logits, ``loss_forward`` (``cost.torch_memory.loss_forward_bytes``), the larger.
    Measured: the peak of every ZeRO 3 run of ``benchmarks/_memory_deepspeed.py`` is in a forward, with both
    copies of the prefetched weights live."""
    prefetched = np.minimum(PREFETCH_BUCKET_DEFAULT, np.maximum(1, params)) * weight_bytes
    held = reduce_bucket(params) * grad_bytes + zero3_gathered(params, weight_bytes) + prefetched
    not_yet = np.maximum(transient, loss_gradients) - np.maximum(transient, loss_forward)
    return np.where(zero == 3, held - not_yet, 0.0)


def after_backward_bytes(zero, params, dp, grad_bytes, largest_parameter=0, offload=False):
    """What the gradient reduction after the last backward adds (activations are freed by then): ZeRO 0
    (``engine.buffered_allreduce_fallback``) flattens up to 5e8 elements of gradients into one tensor and all-
    reduces it; ZeRO 2 (``allreduce_bucket`` in the backward's epilogue) flattens the bucket beside the bucket
    itself: two buckets. ZeRO 3 reduces a bucket that holds the whole model in the backward's epilogue
    (``independent_gradient_partition_epilogue``): ``reduce_scatter_coalesced`` concatenates the bucket's
    gradients, padded, into a flat copy beside it and reduce-scatters into a new partition (1 / dp of it).
    ZeRO 2's gradient partition (``copy_grads_in_partition``) is sized by the whole numel of
    every parameter with an element in the rank's partition: a parameter cut by each of its (one or two)
    boundaries counts whole, at most the largest parameter per boundary beyond the priced P / dp (on the host when
    offloading: ``offloaded_gradient_bytes``)."""
    bucket = reduce_bucket(params) * grad_bytes
    straddling = np.where(offload, 0.0, np.minimum(dp - 1, 2) * np.minimum(largest_parameter, params) * grad_bytes)
    zero3 = 2 * bucket + bucket / dp
    return np.where(zero == 0, bucket, np.where(zero == 2, 2 * bucket + straddling, np.where(zero == 3, zero3, 0.0)))


def step_bytes(zero, params, dp, grad_bytes, master_bytes, moment_bytes, grads):
    """The optimizer step's working set beyond the states, less the priced gradients it frees first. The
    gradients the step reads become a float32 (master-dtype) partition (ZeRO 1-2 ``step``:
    ``flatten(averaged_gradients).to(fp32)``, the bf16 gradients then freed; ZeRO 0's ``BF16_Optimizer`` casts
    its flat gradients into float32 ``.grad`` of each master weight and keeps the bf16 ones; 32-true under
    ZeRO 0 steps the torch optimizer on the gradients themselves), and AdamW's foreach step (CUDA's default)
    takes the square root of the second moments into a new list (``_multi_tensor_adam``: ``_foreach_sqrt``):
    one more moment-sized tensor per parameter of the partition."""
    shard = params / np.where(zero >= 1, dp, 1)
    copy = np.where((zero == 0) & (grad_bytes == master_bytes), 0.0, master_bytes)
    freed = np.where(zero == 0, 0.0, grads)
    return (copy + moment_bytes) * shard - freed


def zero3_copy_bytes(zero, offload, params, dp, partition_copy):
    """ZeRO 3 without a master copy in K (training in the weights' dtype) still updates a separate partition:
    ``stage3.py`` builds ``fp32_partitioned_groups_flat`` as a copy of the weights' partitions whatever their
    dtype, where ``cost.model`` assumes ZeRO 3 updates the shards in place. On the host when offloading."""
    return np.where((zero == 3) & ~offload, partition_copy * params / dp, 0.0)


def offload_staging_bytes(zero, offload, params, weight_bytes, largest_parameter):
    """ZeRO 1-2 with the optimizer offloaded stage each gradient on its way to the host in a device buffer of the
    largest parameter's size in the weights' dtype (``stage_1_and_2.py``: ``temp_grad_buffer_for_gpu_offload``),
    held for the whole run (its host twin ``temp_grad_buffer_for_cpu_offload`` is not on the device)."""
    return np.where(offload & (zero >= 1) & (zero <= 2), np.minimum(largest_parameter, params) * weight_bytes, 0.0)


def offloaded_gradient_bytes(zero, offload, grads):
    """ZeRO 2 and 3 with the optimizer offloaded keep no gradient partition on the device, so the gradients
    ``cost.model`` prices on the device are taken back. ZeRO 2 copies each reduced bucket into the host's float32
    gradient partition (``stage_1_and_2.py``: ``offload_gradient_dict``, ``async_accumulate_grad_in_cpu_via_gpu``);
    ZeRO 3 allocates its gradient partitions (``grad_partitions_flat_buffer``) on the offload device
    (``stage3.py``: ``self.device`` is the CPU under ``offload_optimizer``) and accumulates the micro-batches there;
    the float32 gradients the host's step reads (``fp32_partitioned_groups_flat[i].grad``) are on the host too.
    ZeRO 1 accumulates whole gradients on the device until the last micro-batch, as priced."""
    return np.where(offload & (zero >= 2), -np.asarray(grads, dtype=float), 0.0)


def extra_bytes(zero, offload, params, dp, weight_bytes, grad_bytes, master_bytes, moment_bytes, partition_copy,
                grads, activations, largest_parameter=0, transient=0.0, loss_gradients=0.0, largest_tied=0,
                loss_forward=0.0):
    """DeepSpeed's peak beyond cost.model's weights, gradients, optimizer states, activations and working set
    (the larger of a recomputed block's ``transient`` and the loss's ``loss_gradients``): the largest of what the
    forward (ZeRO 3) or the backward adds, what the end of the backward adds for a tied weight of
    ``largest_tied`` elements, and what the reduction after it or the step adds once activations are freed. An
    offloaded optimizer steps on the host: its working set is not on the device."""
    step = np.where(offload, 0.0, step_bytes(zero, params, dp, grad_bytes, master_bytes, moment_bytes, grads))
    later = np.maximum(after_backward_bytes(zero, params, dp, grad_bytes, largest_parameter, offload), step)
    during = np.maximum(in_backward_bytes(zero, params, grad_bytes, weight_bytes, largest_parameter),
                        zero3_forward_bytes(zero, params, grad_bytes, weight_bytes, transient, loss_gradients,
                                            loss_forward))
    working = np.maximum(transient, loss_gradients)
    during = np.maximum(during, tied_gradient_bytes(zero, params, grad_bytes, largest_tied) - activations - working)
    peak = np.maximum(0.0, np.maximum(during, later - activations))
    return peak + zero3_copy_bytes(zero, offload, params, dp, partition_copy) + \
        offload_staging_bytes(zero, offload, params, weight_bytes, largest_parameter) + \
        offloaded_gradient_bytes(zero, offload, grads)


__all__ = ["ALLGATHER_BUCKET_DEFAULT", "PREFETCH_BUCKET_DEFAULT", "REDUCE_BUCKET_DEFAULT", "after_backward_bytes",
           "bucket_sizes", "extra_bytes", "in_backward_bytes", "largest_tied_parameter", "master_and_moment_bytes",
           "offload_staging_bytes", "offloaded_gradient_bytes", "reduce_bucket", "step_bytes", "tied_gradient_bytes",
           "zero3_copy_bytes", "zero3_forward_bytes", "zero3_gathered"]
