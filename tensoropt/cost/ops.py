"""Per-op compute time and memory, vectorised over the ops of a block (numpy arrays).

Roofline per op (Williams et al., 2009): time = max(FLOPs / (peak x efficiency(FLOPs)),
bytes / achieved memory bandwidth) + a fixed launch overhead. Matrix products, convolutions and
attention run at the profile's efficiency for their size; other ops are memory-bound. Backward
moves about twice the forward's bytes (it reads the output gradient and the saved inputs and
writes input and weight gradients). Work divides by ``shard`` (the tensor-parallel degree for a
sharded op); activation work scales with the micro-batch size, parameter reads do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph.ir import Op
from .profile import DeviceProfile

PRODUCT_KINDS = ("matmul", "conv", "attention")


@dataclass(frozen=True)
class OpArrays:
    """Per-op quantities of a sequence of ops at micro-batch size 1."""

    forward_flops: np.ndarray
    backward_flops: np.ndarray
    activation_bytes: np.ndarray     # read + written, parameters excluded
    parameter_bytes: np.ndarray      # parameter bytes read
    saved_bytes: np.ndarray
    product: np.ndarray              # bool: runs at matrix-unit efficiency
    needs_backward: np.ndarray       # bool
    peak_flops: np.ndarray

    @staticmethod
    def of(ops: tuple[Op, ...], profile: DeviceProfile) -> OpArrays:
        def param_bytes(op: Op) -> int:
            return sum(m.nbytes for m, r in zip(op.inputs, op.sources) if r.kind == "param")
        return OpArrays(
            forward_flops=np.array([op.forward_flops for op in ops], dtype=float),
            backward_flops=np.array([op.backward_flops for op in ops], dtype=float),
            activation_bytes=np.array([op.bytes_read + op.bytes_written - param_bytes(op) for op in ops], dtype=float),
            parameter_bytes=np.array([param_bytes(op) for op in ops], dtype=float),
            saved_bytes=np.array([op.saved_bytes for op in ops], dtype=float),
            product=np.array([op.kind in PRODUCT_KINDS for op in ops], dtype=bool),
            needs_backward=np.array([op.requires_grad or op.backward_flops > 0 for op in ops], dtype=bool),
            peak_flops=np.array([profile.peak(op.outputs[0].dtype if op.outputs else "bfloat16") for op in ops]),
        )


def efficiency(flops: np.ndarray, profile: DeviceProfile) -> np.ndarray:
    """The profile's efficiency curve, piecewise linear in log10(FLOPs), constant beyond its ends."""
    xs = np.log10([f for f, _ in profile.matmul_efficiency])
    ys = np.array([e for _, e in profile.matmul_efficiency])
    return np.interp(np.log10(np.maximum(flops, 1.0)), xs, ys)


def op_times(arrays: OpArrays, shard: np.ndarray, micro_batch: int,
             profile: DeviceProfile) -> tuple[np.ndarray, np.ndarray]:
    """(forward_s, backward_s) per op on one device."""
    fwd_flops = arrays.forward_flops * micro_batch / shard
    bwd_flops = arrays.backward_flops * micro_batch / shard
    moved = (arrays.activation_bytes * micro_batch + arrays.parameter_bytes) / shard
    mem_s = moved / profile.memory_bytes_per_s
    fwd_rate = arrays.peak_flops * np.where(arrays.product, efficiency(fwd_flops, profile), 1.0)
    bwd_rate = arrays.peak_flops * np.where(arrays.product, efficiency(fwd_flops, profile), 1.0)
    overhead = profile.kernel_overhead_s
    fwd = np.maximum(fwd_flops / fwd_rate, mem_s) + overhead
    bwd = np.where(arrays.needs_backward, np.maximum(bwd_flops / bwd_rate, 2 * mem_s) + overhead, 0.0)
    return fwd, bwd
