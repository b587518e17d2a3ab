"""The sum of the micro-batches' gradients: a memory-bound pass over a rank's gradients for every micro-batch after
the first, outside the products (issue 35).

Each micro-batch's backward makes fresh weight gradients in the dtype the products run in (the gathered weights'),
and the runtime adds them to the ones accumulated before:
- gradients held whole (ZeRO 0 and 1) in the fresh gradients' dtype: autograd's ``AccumulateGrad`` adds each in
  place (``.grad += new``): the old read, the new read, the sum written, 3 x its width per parameter (DDP under
  ``no_sync``, DeepSpeed's bf16 gradients, the torch engine's bf16 gradients);
- held whole in a wider dtype: FSDP2's ZeRO 1 with a float32 ``reduce_dtype`` over bf16 weights casts the first
  micro-batch's gradient into its float32 accumulator (``FSDPParam.to_accumulated_grad_if_needed``: the fresh
  read, the float32 copy written) and adds every later one into it (``accumulate_unsharded_grad_if_needed``: the
  fresh and the float32 sum read, the sum written); torch 2.13 ``_fsdp_param.py``;
- sharded over dp (ZeRO 2 and 3): each micro-batch's reduce-scatter hands the rank its shard, added to the shard
  accumulated before: 3 x the held width per parameter, over dp.
Megatron-LM's products add into its float32 gradient buffer themselves (``--gradient-accumulation-fusion``: the
weight-gradient GEMM with beta 1): no separate pass (``Runtime.fuses_accumulation``); DeepSpeed's ZeRO 3 offload
sums on the host (priced in ``cost.offload``).
Each pass streams large contiguous tensors, at the profile's copy rate (``DeviceProfile.copy_bytes_per_s``: STREAM's
Copy; its Add, the same three-array pattern as these sums, ran within 2% of it on the H100 it was measured on:
3,120 against 3,065 GB/s, KempnerInstitute/nvidia-hpc-benchmarks ``p4_nvidia_stream/runs``). The one kernel per
parameter tensor each pass launches is left out (~5 us each: under 1% of the bytes' time for layers of 10^7+ weights).
"""

from __future__ import annotations

import numpy as np

from .profile import DeviceProfile


def accumulation_bytes(params, micro_batches, zero, dp, grad_bytes, fresh_bytes):
    """Bytes a step's gradient sums move on one rank: ``params`` elements of the rank's stage, ``grad_bytes`` the
    width the gradients are held in, ``fresh_bytes`` that of a micro-batch's fresh gradients (the weights the
    products read)."""
    params, m, zero = np.asarray(params, dtype=float), np.asarray(micro_batches), np.asarray(zero)
    grad, fresh = np.asarray(grad_bytes, dtype=float), np.asarray(fresh_bytes, dtype=float)
    whole = zero <= 1
    widened = whole & (fresh != grad)
    later = np.where(widened, fresh + 2 * grad, 3 * grad)
    first = np.where(widened, fresh + grad, 0.0)
    per_pass = np.where(whole, params, params / np.asarray(dp))
    return np.where(m > 1, per_pass * ((m - 1) * later + first), 0.0)


def accumulation_s(params, micro_batches, zero, dp, grad_bytes, fresh_bytes, off_device, profile: DeviceProfile):
    """Seconds of ``accumulation_bytes`` at the copy rate; none where ``off_device``: the products accumulate
    (``Runtime.fuses_accumulation``), or DeepSpeed's ZeRO 3 offload sums the partitions on the host
    (``cost.offload.gradient_copies``)."""
    nbytes = accumulation_bytes(params, micro_batches, zero, dp, grad_bytes, fresh_bytes)
    return np.where(off_device, 0.0, nbytes / profile.copy_bytes_per_s)


__all__ = ["accumulation_bytes", "accumulation_s"]
