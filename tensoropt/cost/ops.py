"""Per-op compute time and memory, vectorised over the ops of a block (numpy arrays).

Roofline per op (Williams et al., 2009): time = max(FLOPs / (peak x efficiency(FLOPs)),
bytes / achieved memory bandwidth) + a fixed launch overhead. Matrix products, convolutions and
attention run at the profile's efficiency for their size (a grouped product, one per expert, at its groups' size
and the profile's ``grouped_matmul_efficiency`` of it: ``product_groups``; a fused attention at the profile's measured
``attention_efficiency`` of it, where the profiler measured one); other ops are memory-bound. A fused attention under
a causal mask computes only the key tiles on and below the diagonal, about half the FLOPs the graph counts
(``causal_fraction``), and is priced on that work: on a measured profile at the kernel's measured rate of it (the
profiler times causal kernels and divides their work by the time), on a datasheet profile at the matmul curve (whose
constants were fitted on public runs priced so, issue 35). A bidirectional attention costs twice a causal one; an
explicit-softmax ("eager") attention, a product that computes every score, its counted FLOPs. Backward
moves about twice the forward's bytes (it reads the output gradient and the saved inputs and
writes input and weight gradients). Chains of memory-bound ops are priced as fused only where the plan
runs compiled (or Megatron-style fused) kernels (``fused``: the plan's ``compile``) on a device whose profile
says compilation fuses them (``fuses_memory_bound_ops``: GPUs); eager PyTorch launches one kernel per op,
each reading and writing its tensors in full (the torch engine as it runs today). Work divides by ``shard`` (the
tensor-parallel degree for a sharded op); activation work scales with the micro-batch size,
parameter reads do not.
Autograd adds work of its own to the backward, which no forward op stands for and an op timed
alone does not show (``autograd_glue_bytes``): gradients of a tensor read by several ops are summed,
and an op that reads a slice of a tensor hands back a zero-filled gradient of the whole tensor.
Where the device profile holds a measured time for the op (``tensoropt profile --model``), that
time replaces the roofline: the time at one tensor-parallel rank's shapes (``key@tpN``) if it was
measured, else the unsharded time scaled by micro-batch / shard (all measured at batch 1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
    glue_bytes: np.ndarray           # memory traffic autograd adds to the op's backward (activation-sized)
    product: np.ndarray              # bool: runs at matrix-unit efficiency
    needs_backward: np.ndarray       # bool
    peak_flops: np.ndarray
    groups: np.ndarray               # products a grouped product (``_grouped_mm``) runs at once; 1 for the rest
    grouped_kernel: np.ndarray       # bool: a bf16 grouped product, run by the grouped kernel (not a loop of mm)
    attention: np.ndarray            # bool: a fused attention op (priced at ``attention_efficiency``)
    work: np.ndarray                 # share of the op's FLOPs its kernel computes (a causal fused attention's ~1/2)
    measured_forward_s: np.ndarray   # profiler's time at the captured shapes, nan where not measured
    measured_backward_s: np.ndarray
    measured_sharded: tuple = ()     # (tp, forward_s array, backward_s array) at one rank's shapes

    def subset(self, indices: list[int]) -> OpArrays:
        """These arrays for the ops at ``indices`` only (their measured times kept, no sharded ones)."""
        return OpArrays(**{f.name: getattr(self, f.name)[indices] for f in fields(self)
                           if f.name != "measured_sharded"})

    @staticmethod
    def of(ops: tuple[Op, ...], profile: DeviceProfile, fused: bool = False) -> OpArrays:
        """The arrays of ``ops``; ``fused``: priced as compiled blocks run them (``fused_bytes``), where the
        profile's device fuses at all."""
        def param_bytes(op: Op) -> int:
            return sum(m.nbytes for m, r in zip(op.inputs, op.sources) if r.kind == "param")
        moved = np.array([op.bytes_read + op.bytes_written - param_bytes(op) for op in ops], dtype=float)
        groups = np.array([product_groups(op) for op in ops], dtype=float)
        return OpArrays(
            forward_flops=np.array([op.forward_flops for op in ops], dtype=float),
            backward_flops=np.array([op.backward_flops for op in ops], dtype=float),
            activation_bytes=moved - (fused_bytes(ops) if fused and profile.fuses_memory_bound_ops else 0.0),
            parameter_bytes=np.array([param_bytes(op) for op in ops], dtype=float),
            saved_bytes=np.array([op.saved_bytes for op in ops], dtype=float),
            glue_bytes=autograd_glue_bytes(ops),
            product=np.array([op.kind in PRODUCT_KINDS for op in ops], dtype=bool),
            needs_backward=np.array([op.requires_grad or op.backward_flops > 0 for op in ops], dtype=bool),
            peak_flops=np.array([profile.peak(op.outputs[0].dtype if op.outputs else "bfloat16") for op in ops]),
            groups=groups,
            grouped_kernel=(groups > 1) & np.array([bool(op.outputs) and op.outputs[0].dtype == "bfloat16"
                                                    for op in ops], dtype=bool),
            attention=np.array([op.kind == "attention" for op in ops], dtype=bool),
            work=np.array([causal_work_fraction(op) for op in ops], dtype=float),
            measured_forward_s=_measured(ops, profile, "", 0),
            measured_backward_s=_measured(ops, profile, "", 1),
            measured_sharded=tuple((tp, _measured(ops, profile, f"@tp{tp}", 0), _measured(ops, profile, f"@tp{tp}", 1))
                                   for tp in profile.sharded_degrees),
        )


# query and key rows per tile of the fused attention kernels (FlashAttention-2's forward runs 128-row query blocks)
CAUSAL_TILE = 128


def causal_fraction(s_q: int, s_k: int) -> float:
    """The share of a causal attention's FLOPs (counted unmasked: ``graph.opinfo.attention_flops``) that a fused
    kernel computes: flash, memory-efficient and cuDNN attention skip the key tiles wholly above the diagonal and
    compute those on it masked, (n + 1) / (2 n) of the n x n tiles of a sequence of n tiles (Dao, FlashAttention-2,
    2023, sec. 3.1.1, "causal masking"); 1 for queries and keys of different lengths, whose alignment is not known
    here."""
    if s_q != s_k:
        return 1.0
    tiles = -(-s_q // CAUSAL_TILE)
    return (tiles + 1) / (2 * tiles)


def causal_work_fraction(op: Op) -> float:
    """``causal_fraction`` of a fused attention op run with ``is_causal``; 1 for every other op."""
    if op.kind != "attention" or dict(op.attrs).get("is_causal") != "True" or len(op.inputs) < 2:
        return 1.0
    return causal_fraction(op.inputs[0].shape[-2], op.inputs[1].shape[-2])


def product_groups(op: Op) -> int:
    """The products a grouped product runs at once (one per expert: ``aten._grouped_mm``'s ``offs`` holds one end
    per group, or its 3-D operand stacks one matrix per group); 1 for every other op. Each group's product is a
    matrix product of its own rows (tokens x top-k / experts, balanced), and reaches the efficiency of a product of
    its own size, not of the whole op's FLOPs: 128 experts of 2048 rows each run as 128 products of 1/128 the FLOPs
    (``op_times``)."""
    if not op.target.startswith("aten._grouped_mm"):
        return 1
    if len(op.inputs) >= 3 and len(op.inputs[2].shape) == 1 and op.inputs[2].dtype.startswith("int"):
        return max(1, op.inputs[2].shape[0])
    stacked = [m.shape[0] for m in op.inputs[:2] if len(m.shape) == 3]
    return max(1, stacked[0]) if stacked else 1


def _measured(ops: tuple[Op, ...], profile: DeviceProfile, suffix: str, which: int) -> np.ndarray:
    return np.array([(profile.op_time(op.key() + suffix) or (np.nan, np.nan))[which] for op in ops], dtype=float)


def fused_bytes(ops: tuple[Op, ...]) -> np.ndarray:
    """Bytes each op does not move because it is fused with its producer.

    Chains of memory-bound ops run as one kernel on GPUs (Megatron-LM's fused scale-mask-softmax
    and bias-GeLU kernels, torch.compile's fusion): when a memory-bound op is the only reader of
    a memory-bound producer's output, it reads that tensor from registers, and the producer does
    not write it unless autograd keeps it for backward. ``OpArrays.of`` applies this only to compiled plans
    on a profile whose ``fuses_memory_bound_ops`` is true."""
    index = {op.index: i for i, op in enumerate(ops)}

    def producer(ref):
        if ref.kind in ("local", "op") and ref.index in index:
            return index[ref.index]
        return None

    readers = np.zeros(len(ops), dtype=int)
    for op in ops:
        for ref in op.sources:
            if (j := producer(ref)) is not None:
                readers[j] += 1
    saved = np.zeros(len(ops))
    for i, op in enumerate(ops):
        for meta, ref in zip(op.inputs, op.sources):
            j = producer(ref)
            if j is None or readers[j] != 1 or ops[j].kind in PRODUCT_KINDS or op.kind in PRODUCT_KINDS:
                continue
            saved[i] += meta.nbytes                            # not read back by the consumer
            if ops[j].saved_bytes == 0:
                saved[j] += ops[j].outputs[ref.slot].nbytes    # nor written by the producer
    return saved


def autograd_glue_bytes(ops: tuple[Op, ...]) -> np.ndarray:
    """Bytes autograd's own kernels move in the backward, charged to the op that causes them.

    - A tensor that k ops with gradients read receives k gradients, which autograd sums as they
      arrive: k - 1 additions, each reading two tensors and writing one (the residual stream, a fused
      projection split into q, k and v).
    - An op that reads a narrowed view (a slice, select or split: fewer elements than the tensor it
      views) gets back, from the view's backward, a gradient of the whole tensor: zeros written over
      all of it and the slice's gradient copied in (PyTorch's ``slice_backward``).
    Sizes are at the captured batch; the caller scales them like other activation bytes."""
    by_index = {op.index: op for op in ops}

    def tensor_bytes(ref, read_bytes: int) -> int:
        """The whole tensor behind an input (the reader's own view where the producer is not in ``ops``)."""
        producer = ops[ref.index] if ref.kind in ("local", "prev") and ref.index < len(ops) else by_index.get(ref.index)
        if producer is None or ref.slot >= len(producer.outputs):
            return read_bytes
        return max(producer.outputs[ref.slot].nbytes, read_bytes)

    glue = np.zeros(len(ops))
    readers: dict[tuple, int] = {}
    for i, op in enumerate(ops):
        if not op.requires_grad:
            continue
        for meta, ref in zip(op.inputs, op.sources):
            if ref.kind in ("param", "buffer", "input", "const") or meta.dtype.startswith(("int", "uint", "bool")):
                continue
            whole = tensor_bytes(ref, meta.nbytes)
            key = (ref.kind, ref.index, ref.slot)
            if readers.get(key, 0):
                glue[i] += 3 * whole
            readers[key] = readers.get(key, 0) + 1
            if meta.nbytes < whole:
                glue[i] += whole + 2 * meta.nbytes
    return glue


def efficiency(flops: np.ndarray, profile: DeviceProfile) -> np.ndarray:
    """The profile's efficiency curve, piecewise linear in log10(FLOPs), constant beyond its ends."""
    return curve_efficiency(flops, profile.matmul_efficiency)


def curve_efficiency(flops, curve) -> np.ndarray:
    """An efficiency curve of (FLOPs, fraction of peak) points at ``flops``: piecewise linear in log10(FLOPs),
    constant beyond its ends (also what the profiler reads its measured curve with)."""
    xs = np.log10([f for f, _ in curve])
    ys = np.array([e for _, e in curve])
    return np.interp(np.log10(np.maximum(flops, 1.0)), xs, ys)


def op_times(arrays: OpArrays, shard: np.ndarray, micro_batch: int,
             profile: DeviceProfile) -> tuple[np.ndarray, np.ndarray]:
    """(forward_s, backward_s) per op on one device. Elementwise: ``shard`` may be a (keys x ops) array and
    ``micro_batch`` a (keys x 1) one, each row then what its own call gives (``BlockCost.prepare``)."""
    fwd_flops = arrays.forward_flops * micro_batch / shard
    bwd_flops = arrays.backward_flops * micro_batch / shard
    moved = (arrays.activation_bytes * micro_batch + arrays.parameter_bytes) / shard
    mem_s = moved / profile.memory_bytes_per_s
    # a grouped product runs each group's product at the efficiency of its own size; in bf16 torch runs it with its
    # grouped kernel, which reaches the profile's fraction of a plain product's (``grouped_matmul_efficiency``; other
    # dtypes fall back to one mm per group: ``_grouped_mm_fallback`` in ATen's GroupedMMUtils.h)
    product_eff = efficiency(fwd_flops / arrays.groups, profile) \
        * np.where(arrays.grouped_kernel, profile.grouped_matmul_efficiency, 1.0)
    # the FLOPs the kernels compute: a causal fused attention's tiles on and below the diagonal, about half the
    # FLOPs counted (``work``; under context parallelism each rank's chunks against the keys up to their ends, 1/cp of
    # that work: ``cost.context_parallel``)
    fwd_work, bwd_work = fwd_flops * arrays.work, bwd_flops * arrays.work
    if profile.attention_measured:
        # the fused attention kernel at its measured rate of the work it does (``attention_efficiency``: a fraction
        # of a product's rate at its FLOPs); a datasheet profile runs it at the matmul curve
        product_eff = product_eff * np.where(arrays.attention,
                                             curve_efficiency(fwd_flops, profile.attention_efficiency), 1.0)
    product_eff = np.minimum(product_eff, 1.0)
    fwd_rate = arrays.peak_flops * np.where(arrays.product, product_eff, 1.0)
    bwd_rate = fwd_rate                     # the backward's matmuls run at the forward's shapes' efficiency
    overhead = profile.kernel_overhead_s
    fwd = np.maximum(fwd_work / fwd_rate, mem_s) + overhead
    bwd = np.where(arrays.needs_backward, np.maximum(bwd_work / bwd_rate, 2 * mem_s) + overhead, 0.0)
    # measured ops: the profiler's time at the captured shapes, scaled by the work this device does;
    # better, where it exists, its time at one tensor-parallel rank's own shapes
    scale = micro_batch / shard
    measured = ~np.isnan(arrays.measured_forward_s)
    fwd = np.where(measured, arrays.measured_forward_s * scale, fwd)
    bwd = np.where(measured & arrays.needs_backward, arrays.measured_backward_s * scale, bwd)
    for tp, local_fwd, local_bwd in arrays.measured_sharded:
        local = (shard == tp) & ~np.isnan(local_fwd)
        fwd = np.where(local, local_fwd * micro_batch, fwd)
        bwd = np.where(local & arrays.needs_backward, local_bwd * micro_batch, bwd)
    glue_s = arrays.glue_bytes * micro_batch / shard / profile.memory_bytes_per_s
    return fwd, bwd + np.where(arrays.needs_backward, glue_s, 0.0)
