"""Device micro-benchmarks: matrix products over shapes and dtypes (the efficiency curve), a grouped product
(Mixture-of-Experts layers' kernel), causal fused attentions (forward and backward), memory bandwidth, the fixed cost
of launching one op, the optimizer step rate, and the host link.

Every figure is the median of several timed samples after a warm-up, each sample back-to-back
calls between CUDA events on a GPU (``perf_counter`` on a CPU): see ``timed``. Nothing here is used
by the planner directly: ``run.py`` turns the measurements into a profile.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from ..cost.ops import causal_fraction
from ..graph.opinfo import attention_flops


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


MIN_SAMPLE_S = 1e-3       # a timed sample runs enough back-to-back calls to last this long
MAX_CALLS = 100           # ... but never more calls than this


def timed(fn: Callable[[], object], device: str, repeats: int, warmup: int = 1) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` samples.

    A sample times back-to-back calls (as many as last ``MIN_SAMPLE_S``, at most ``MAX_CALLS``) and
    divides: one call timed alone measures the host's launch and synchronisation as much as the work.
    On a GPU the sample is read between two CUDA events recorded on the stream around the calls (the
    device's time for the kernels); on a CPU, with ``perf_counter``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    calls = max(1, min(MAX_CALLS, math.ceil(MIN_SAMPLE_S / max(_sample_s(fn, device, 1), 1e-9))))
    return statistics.median(_sample_s(fn, device, calls) for _ in range(repeats))


def _sample_s(fn: Callable[[], object], device: str, calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls       # elapsed_time is in milliseconds
    start_s = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start_s) / calls


def matmul(n: int, dtype: torch.dtype, device: str, repeats: int) -> dict:
    """An n x n x n product: seconds and achieved FLOP/s (2 n^3 FLOPs)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds = timed(lambda: a @ b, device, repeats)
    flops = 2.0 * n**3
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "seconds": seconds, "flops": flops,
            "flops_per_s": flops / seconds}


def grouped_matmul(groups: int, rows: int, k: int, n: int, dtype: torch.dtype, device: str, repeats: int) -> dict:
    """One grouped product as Mixture-of-Experts layers run it (``torch.nn.functional.grouped_mm``: ``groups`` x
    ``rows`` token rows, each group's rows times its own k x n matrix): seconds, achieved FLOP/s and the FLOPs of one
    group's product (what the cost model reads the efficiency curve at, ``cost.ops.product_groups``)."""
    a = torch.randn(groups * rows, k, dtype=dtype, device=device)
    b = torch.randn(groups, k, n, dtype=dtype, device=device)
    offs = torch.arange(rows, groups * rows + 1, rows, dtype=torch.int32, device=device)
    seconds = timed(lambda: torch.nn.functional.grouped_mm(a, b, offs=offs), device, repeats)
    flops = 2.0 * groups * rows * k * n
    return {"groups": groups, "rows": rows, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."),
            "seconds": seconds, "flops": flops, "flops_per_s": flops / seconds, "group_flops": flops / groups}


def attention(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, device: str, repeats: int) -> dict:
    """One causal fused attention as a training step runs it (``scaled_dot_product_attention``, forward then the
    gradients of its three inputs): seconds, its FLOPs counted as the graph counts them (forward 4 b h s^2 d, causal
    masking not discounted, ``graph.opinfo.attention_flops``; backward twice that), the share of them a fused kernel
    computes (``work``: the tiles on and below the diagonal, ``cost.ops.causal_fraction``), and the rate of that
    work: what the cost model prices the op's work at (``cost.ops.op_times``)."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)
    seconds = timed(step, device, repeats)
    forward = float(attention_flops(q, k))
    work = causal_fraction(seq, seq)
    return {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "seconds": seconds, "forward_flops": forward,
            "flops": 3 * forward, "work": work, "flops_per_s": 3 * forward * work / seconds}


def memory_bandwidth(numel: int, device: str, repeats: int) -> dict:
    """Copy of ``numel`` float32 elements: read + write bytes per second."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats)
    moved = 2.0 * numel * 4
    return {"bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds}


def op_overhead(device: str, repeats: int) -> float:
    """Seconds to run one trivial op: the framework's fixed per-op cost."""
    x = torch.ones(1, device=device)
    return timed(lambda: torch.add(x, x), device, repeats)


def adam_rate(params: int, device: str, repeats: int) -> float:
    """Parameters per second one AdamW step updates (the offload path's CPU optimizer rate when
    measured on the CPU)."""
    weight = torch.nn.Parameter(torch.randn(params, device=device))
    weight.grad = torch.randn_like(weight)
    optimizer = torch.optim.AdamW([weight], lr=1e-4)
    return params / timed(optimizer.step, device, repeats)


def host_copies(numel: int, repeats: int) -> list[dict]:
    """Pinned host -> device and device -> host copies of ``numel`` float32 elements: bytes per second each
    way (what optimizer offload moves every step)."""
    host = torch.empty(numel, pin_memory=True)
    gpu = torch.empty(numel, device="cuda")
    out = []
    for direction, copy in (("host_to_device", lambda: gpu.copy_(host, non_blocking=True)),
                            ("device_to_host", lambda: host.copy_(gpu, non_blocking=True))):
        seconds = timed(copy, "cuda", repeats)
        out.append({"direction": direction, "bytes": numel * 4, "seconds": seconds, "bytes_per_s": numel * 4 / seconds})
    return out
