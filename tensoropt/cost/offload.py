"""Time of DeepSpeed's optimizer offload (ZeRO-Offload, Ren et al., USENIX ATC'21) as DeepSpeed 0.19.8 runs it:
the optimizer's step on the host, and the gradient copies between the device and the host that the micro-batches
of a step make before it. Pure functions of arrays or numbers; the torch engine does not offload."""

from __future__ import annotations

import numpy as np

# host bytes per parameter of the offloaded step: torch.optim.AdamW's passes on the CPU (the script's optimizer: the
# DeepSpeed engine sets zero_force_ds_cpu_optimizer false), eight passes over float32 tensors as counted in
# ``torch_mixed`` (the single-tensor loop torch runs on CPU tensors makes the same passes as the foreach one)
HOST_ADAM_BYTES = 80
OFFLOADED_GRAD_BYTES = 4       # DeepSpeed copies each gradient partition to the host in float32 (the master dtype)


def offload_step_s(opt_params, weight_bytes, prof):
    """Seconds of the optimizer step under DeepSpeed's optimizer offload, which does not overlap the GPU's work
    (ZeRO 1-2 ``step`` with ``cpu_offload``, DeepSpeed 0.19.8 ``stage_1_and_2.py``): the gradient partition goes to
    the host in float32 (4 bytes per parameter, pinned); the host runs AdamW (``cpu_adam_params_per_s``, what
    ``tensoropt profile`` measures with torch.optim.AdamW on the host); the updated float32 partition is cast on the
    host into a pinned buffer of the weights' dtype (4 bytes read, ``weight_bytes`` written: host memory traffic,
    priced against AdamW's 80 bytes at the same rate), which is copied to the device (``weight_bytes``, pinned)."""
    host_s = opt_params * (1 + (4 + weight_bytes) / HOST_ADAM_BYTES) / prof.cpu_adam_params_per_s
    return host_s + (OFFLOADED_GRAD_BYTES + weight_bytes) * opt_params / prof.pcie_bandwidth_bytes_per_s


def gradient_copies(zero, micro_batches):
    """How many times a step moves the rank's gradient partition, in the gradients' dtype, between the device and
    the host before the optimizer's step, where the offloaded engine keeps the running sum of the micro-batches:
    - ZeRO 1 reduces once, at the last micro-batch, with ``micro_step_id`` back at 0: none
      (``stage_1_and_2.py``, ``copy_grads_in_partition``; seen on CPU by ``tests/test_offload_price.py``);
    - ZeRO 2 with more than one micro-batch (``async_accumulate_grad_in_cpu_via_gpu``): the first micro-batch copies
      its gradients to the host, every later one copies the sum back, adds its own on the device and copies the
      sum out again: 2m - 1 copies. Unless the engine accumulates in float32 (the compact buffer of
      ``_use_compact_grad_partition_buffer``), which the engine's config never asks for (``grad_accum_dtype``);
    - ZeRO 3 keeps the gradient partitions on the host (``stage3.py``, ``partition_grads``): every micro-batch copies
      its partition out and the sum back (the first: out, then back to the device for the norms): 2m copies."""
    zero, m = np.asarray(zero), np.asarray(micro_batches)
    return np.where(zero == 3, 2 * m, np.where((zero == 2) & (m > 1), 2 * m - 1, 0))


def gradient_copies_s(zero, micro_batches, opt_params, grad_bytes, prof):
    """Seconds of ``gradient_copies`` over the host link. ZeRO 1-2 issue them on the compute stream (``overlap_comm``
    is off below ZeRO 3), so they add to the step; ZeRO 3 issues them on its reduction stream beside the backward,
    priced the same: an upper bound (0.08 s of the 25.2 s of the README's chosen GPT-3 175B plan, dp256 ZeRO 3)."""
    return gradient_copies(zero, micro_batches) * opt_params * grad_bytes / prof.pcie_bandwidth_bytes_per_s
