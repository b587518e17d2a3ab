"""DeepSpeed's own buffers, beside the model states ``cost.model`` prices for every engine.

DeepSpeed sizes its communication buffers by config, in elements, not by the model: ZeRO 1-2 allocate each
gradient reduction bucket at ``reduce_bucket_size`` whole when a backward starts (DeepSpeed 0.19
``runtime/zero/stage_1_and_2.py`` ``setup_buckets``: ``torch.empty(reduce_bucket_size)`` per gradient dtype, a
second one under ``overlap_comm``), whatever the model's size. Its defaults (5e8 elements, ``runtime/zero/
config.py``) were chosen for billion-parameter models on GPUs: on a 0.84M-parameter rank they were 2 GB of
float32 buckets. ``bucket_sizes`` caps each such size at the model's parameter count (a bucket never holds more
gradients than the model has), and the runtime writes exactly those sizes into the config it trains with
(``runtime.deepspeed_engine.deepspeed_config``), so the buffers priced here are the ones that run.
"""

from __future__ import annotations

import numpy as np

# DeepSpeed 0.19's defaults (runtime/zero/config.py), elements
REDUCE_BUCKET_DEFAULT = 500_000_000
ALLGATHER_BUCKET_DEFAULT = 500_000_000
PREFETCH_BUCKET_DEFAULT = 50_000_000


def bucket_sizes(zero: int, parameters: int | None) -> dict:
    """The ``zero_optimization`` bucket sizes (elements) for a model of ``parameters`` parameters: DeepSpeed's
    defaults capped at the model's size (module doc); None (the size is not known): none written, DeepSpeed's
    defaults apply. ``overlap_comm`` is written as DeepSpeed defaults it (on under ZeRO 3 only), so the number
    of reduce buckets priced (``reduce_buffers``) is the config's."""
    if parameters is None:
        return {}
    cap = max(1, int(parameters))
    sizes = {"reduce_bucket_size": min(REDUCE_BUCKET_DEFAULT, cap),
             "allgather_bucket_size": min(ALLGATHER_BUCKET_DEFAULT, cap), "overlap_comm": zero == 3}
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
    initialisation) and the gathered weights it keeps for reuse: ``PartitionedParameterCoordinator`` releases a
    gathered parameter only past ``stage3_max_live_parameters`` (1e9) gathered elements or when its next use is
    further than ``stage3_max_reuse_distance`` (1e9) elements away, so up to min(1e9, parameters) stay
    gathered; and it holds the gradients of a bucket whole, as autograd makes them, until the bucket is full and
    reduce-scattered into the partitions (``__reduce_and_partition_ipg_grads``): a second bucket's worth. ZeRO 0
    reduces after the backward (``after_backward_bytes``). ZeRO 1-2 also hold a parameter's fresh gradient
    beside the one accumulated before (autograd's ``AccumulateGrad`` adds the new gradient of a tied weight's second
    use, or of a later micro-batch, into ``.grad`` and then frees it; DeepSpeed copies it into the bucket only after
    the hook): at most the largest parameter's; ZeRO 3's second bucket holds every gradient whole already."""
    bucket = reduce_bucket(params) * grad_bytes
    gathered = np.minimum(1e9, params) * weight_bytes
    fresh = np.minimum(largest_parameter, params) * grad_bytes
    return np.where(zero == 0, 0.0, bucket + np.where(zero == 3, gathered + bucket, fresh))


def after_backward_bytes(zero, params, dp, grad_bytes, largest_parameter=0, offload=False):
    """What the gradient reduction after the last backward adds (activations are freed by then): ZeRO 0
    (``engine.buffered_allreduce_fallback``) flattens up to 5e8 elements of gradients into one tensor and all-
    reduces it; ZeRO 2 (``allreduce_bucket`` in the backward's epilogue) flattens the bucket beside the bucket
    itself: two buckets. ZeRO 2's gradient partition (``copy_grads_in_partition``) is sized by the whole numel of
    every parameter with an element in the rank's partition: a parameter cut by each of its (one or two)
    boundaries counts whole, at most the largest parameter per boundary beyond the priced P / dp (on the host when
    offloading: ``offloaded_gradient_bytes``)."""
    bucket = reduce_bucket(params) * grad_bytes
    straddling = np.where(offload, 0.0, np.minimum(dp - 1, 2) * np.minimum(largest_parameter, params) * grad_bytes)
    return np.where(zero == 0, bucket, np.where(zero == 2, 2 * bucket + straddling, 0.0))


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
    """ZeRO 2 with the optimizer offloaded keeps no gradient partition on the device: each reduced bucket is copied
    into the host's float32 gradient partition (``stage_1_and_2.py``: ``offload_gradient_dict``,
    ``async_accumulate_grad_in_cpu_via_gpu``), so the gradients ``cost.model`` prices on the device are taken
    back (ZeRO 1 accumulates whole gradients on the device until the last micro-batch, as priced)."""
    return np.where(offload & (zero == 2), -np.asarray(grads, dtype=float), 0.0)


def extra_bytes(zero, offload, params, dp, weight_bytes, grad_bytes, master_bytes, moment_bytes, partition_copy,
                grads, activations, largest_parameter=0):
    """DeepSpeed's peak beyond cost.model's weights, gradients, optimizer states and activations: the largest
    of what the backward adds and what the reduction after it or the step adds once activations are freed. An
    offloaded optimizer steps on the host: its working set is not on the device."""
    step = np.where(offload, 0.0, step_bytes(zero, params, dp, grad_bytes, master_bytes, moment_bytes, grads))
    later = np.maximum(after_backward_bytes(zero, params, dp, grad_bytes, largest_parameter, offload), step)
    during = in_backward_bytes(zero, params, grad_bytes, weight_bytes, largest_parameter)
    peak = np.maximum(0.0, np.maximum(during, later - activations))
    return peak + zero3_copy_bytes(zero, offload, params, dp, partition_copy) + \
        offload_staging_bytes(zero, offload, params, weight_bytes, largest_parameter) + \
        offloaded_gradient_bytes(zero, offload, grads)


__all__ = ["ALLGATHER_BUCKET_DEFAULT", "PREFETCH_BUCKET_DEFAULT", "REDUCE_BUCKET_DEFAULT", "after_backward_bytes",
           "bucket_sizes", "extra_bytes", "in_backward_bytes", "master_and_moment_bytes", "offload_staging_bytes",
           "offloaded_gradient_bytes",
           "reduce_bucket", "step_bytes",
           "zero3_copy_bytes"]
