"""Run the benchmarks and turn them into a device profile (the schema ``cost/profile.py`` reads).

Fits:
- ``peak_flops`` per dtype: the best matrix-product rate measured; ``matmul_efficiency``: each
  product's rate over that peak, against its FLOPs (the cost model interpolates in log FLOPs and
  holds the end points constant beyond the measured range);
- ``grouped_matmul_efficiency``: one bf16 grouped product (``GROUPED_MATMUL``) at its measured rate over the
  bf16 curve's at one group's FLOPs (``grouped_efficiency``), what the cost model multiplies a grouped product's
  per-group efficiency by;
- ``attention_efficiency``: causal fused attentions (``ATTENTION``, forward and backward, bf16) at their measured
  rates of work (the FLOPs a causal kernel computes, about half the graph's count) over the bf16 curve's at their
  forward FLOPs (``attention_curve``), a (FLOPs, fraction) point each: what the cost model multiplies an attention
  op's efficiency by;
- ``memory_bandwidth_bytes_per_s``: the best copy rate (``memory_efficiency`` 1: it is achieved);
- links: the ring all-reduce model t = 2(n-1)/n * M/B + 2(n-1)*alpha fitted to every all-reduce by
  least squares, giving B (bytes/s per rank) and alpha (latency), for the workers' node. A
  single-host run cannot see an inter-node link: it is recorded equal to the intra-node one and
  the metadata says so. All-gather, reduce-scatter and all-to-all get their own bandwidth, fitted
  with the link's latency (t = (n-1)/n * M/B_op + (n-1)*alpha, M the full tensor): gloo's run at a
  third of its all-reduce rate, and ZeRO's sharded data parallelism is made of them. With one
  device there is nothing to measure: both links are copied from a named datasheet profile
  (``Settings.link_profile``), and the metadata and the summary say which;
- ``host.pcie_bandwidth_bytes_per_s``: on a GPU, the slower direction of pinned host<->device copies
  (optimizer offload moves gradients down and parameters up every step); on a CPU there is no such
  link and the memory bandwidth stands in;
- ``host.cpu_adam_params_per_s``: ``torch.optim.AdamW`` steps on the host in float32, the optimizer
  DeepSpeed runs for offload under the engine's config (the script's own optimizer, not
  DeepSpeedCPUAdam), with the host threads one worker of ``nproc`` gets.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch

from ..cost.ops import curve_efficiency
from . import collectives
from . import device as bench
from .host import device_name, memory_bytes
from .store import threads_per_worker

# "adam": an offloaded optimizer updates a partition of GBs, so the step is timed on 16M parameters (256 MB of
# weight, gradient and moments) in both plans: at 1M (16 MB) AdamW ran from the cache, 232M parameters/s against
# 122M at 16M on one thread of an AMD EPYC VM, and a quick profile's offload priced twice too fast
QUICK = {"matmul": [128, 512, 1024], "memory": [1 << 22], "messages": [1 << 12, 1 << 18, 1 << 24],
         "repeats": 3, "adam": 1 << 24, "host_copy": 1 << 24}
FULL = {"matmul": [64, 128, 256, 512, 1024, 2048, 4096], "memory": [1 << 22, 1 << 25],
        "messages": [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26],
        "repeats": 7, "adam": 1 << 24, "host_copy": 1 << 28}
# a GPU reaches its peak only on large products (an H100: ~800 TFLOP/s bf16 at 8192^3, far less at 4096^3)
GPU_MATMUL = {"quick": [1024, 4096, 8192], "full": [256, 512, 1024, 2048, 4096, 8192, 16384]}
# float32 elements a bandwidth copy moves on a GPU: 1 and 2 GiB, far beyond an H100's 50 MB L2 (a 16 MiB copy
# stays in it); the CPU sizes above (16 and 128 MiB) are beyond a CPU's caches and fit a 24 GiB machine
GPU_MEMORY = {"quick": [1 << 28], "full": [1 << 28, 1 << 29]}
# a CPU without bf16 matrix units (AVX2) multiplies bf16 ~100x slower than float32: a 1024^3 product took 2.55 s a
# call on one thread of an AMD EPYC (0.84 GFLOP/s, against 92 in float32), 13 s of a quick profile's five calls;
# a quick CPU profile stops its bf16 products at 512^3 (0.22 s a call), a full one measures them all
QUICK_CPU_BF16_MAX_N = 512
# the grouped product timed in bf16 (groups, rows per group, k, n): on a GPU Qwen3-30B-A3B's expert gate/up product at
# 2,048 rows per expert (128 experts, hidden 2048, 2 x 768), the shape benchmarks/moe_kernels.py fits the datasheet
# profiles on; on a CPU a small one (bf16 on an AVX2 core runs at ~1 GFLOP/s: ~70 ms a call)
GROUPED_MATMUL = {"cuda": (128, 2048, 2048, 1536), "cpu": (4, 128, 256, 256)}
# the causal attentions timed in bf16, forward and backward (batch, heads, sequence, head dim): on a GPU a Llama's
# heads (32 x 128) at 2K, 4K and 8K tokens; on a CPU small ones (~20 ms and ~0.3 s a step on one AVX2 core)
ATTENTION = {"cuda": ((4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)),
             "cpu": ((1, 4, 128, 64), (1, 4, 512, 64))}
# the CUDA context, NCCL's buffers and the allocator's slack: no benchmark here measures them, so a GPU's
# profile keeps its datasheet profile's figure (3 GiB for an H100); this where there is none
DEFAULT_RUNTIME_OVERHEAD_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Settings:
    device: str
    nproc: int
    quick: bool
    link_profile: str | None = None     # with one device: the datasheet profile the links are copied from

    @property
    def plan(self) -> dict:
        base = QUICK if self.quick else FULL
        if self.device == "cuda":
            size = "quick" if self.quick else "full"
            return base | {"matmul": GPU_MATMUL[size], "memory": GPU_MEMORY[size]}
        return base

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16] if self.device == "cuda" else [torch.float32,
                                                                                            torch.bfloat16]


def matmul_sizes(s: Settings, dtype: torch.dtype) -> list[int]:
    """The n of the n x n x n products timed in ``dtype`` (see QUICK_CPU_BF16_MAX_N)."""
    sizes = s.plan["matmul"]
    if s.quick and s.device == "cpu" and dtype == torch.bfloat16:
        return [n for n in sizes if n <= QUICK_CPU_BF16_MAX_N]
    return sizes


def total_steps(s: Settings) -> int:
    return (sum(len(matmul_sizes(s, dtype)) for dtype in s.dtypes) + len(s.plan["memory"]) + 4
            + len(ATTENTION[s.device]) + collectives.steps(s.nproc, s.plan["messages"]))


def fit_ring(points: list[dict]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the ring all-reduce model, least squares, both > 0."""
    rows = np.array([[2 * (p["group_size"] - 1) / p["group_size"] * p["bytes"], 2 * (p["group_size"] - 1)]
                     for p in points])
    times = np.array([p["seconds"] for p in points])
    (inv_bandwidth, latency), *_ = np.linalg.lstsq(rows, times, rcond=None)
    if inv_bandwidth <= 0:                     # all-latency: take the largest message's rate
        big = max(points, key=lambda p: p["bytes"])
        inv_bandwidth = big["seconds"] / (2 * (big["group_size"] - 1) / big["group_size"] * big["bytes"])
    return 1.0 / inv_bandwidth, max(float(latency), 1e-7)


RING_COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all")


def full_bytes(point: dict) -> float:
    """The full tensor of a measured collective: an all-gather's record gives each rank's input."""
    return point["bytes"] * (point["group_size"] if point["op"] == "all_gather" else 1)


def fit_collective_bandwidth(points: list[dict], latency_s: float) -> float:
    """Bandwidth (bytes/s) of one-pass ring collectives, least squares with the link's latency fixed."""
    volume = np.array([(p["group_size"] - 1) / p["group_size"] * full_bytes(p) for p in points])
    beyond_latency = np.array([p["seconds"] - (p["group_size"] - 1) * latency_s for p in points])
    inv_bandwidth = float(volume @ beyond_latency) / float(volume @ volume)
    if inv_bandwidth <= 0:                     # all-latency: take the largest message's rate
        big = max(points, key=full_bytes)
        inv_bandwidth = big["seconds"] / ((big["group_size"] - 1) / big["group_size"] * full_bytes(big))
    return 1.0 / inv_bandwidth


def link_of(comm: list[dict]) -> dict:
    """The profile's link entry from measured collectives (see the module docstring)."""
    bandwidth, latency = fit_ring([c for c in comm if c["op"] == "all_reduce"])
    by_collective = {op: fit_collective_bandwidth(points, latency) for op in RING_COLLECTIVES
                     if (points := [c for c in comm if c["op"] == op])}
    return {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency, "efficiency": 1.0,
            "collective_bandwidths_bytes_per_s": by_collective}


def runtime_overhead_bytes(device: str, name: str) -> tuple[int, str]:
    """(bytes, where from) of a profile's ``runtime_overhead_bytes``: a GPU's datasheet profile's figure
    (the largest datasheet figure for a GPU without one), ``DEFAULT_RUNTIME_OVERHEAD_BYTES`` on a CPU."""
    from ..cost.profile import load_profile_json
    from ..errors import TensorOptError
    from .store import DATASHEETS, datasheet_profile
    if device != "cuda":
        return DEFAULT_RUNTIME_OVERHEAD_BYTES, "default for a CPU"
    try:
        profile = datasheet_profile(name)
    except TensorOptError:
        figures = {p: int(load_profile_json(p)["runtime_overhead_bytes"]) for _, p in DATASHEETS}
        profile = max(figures, key=figures.get)
        return figures[profile], f"no datasheet profile for this GPU: the largest, {profile}'s"
    return int(load_profile_json(profile)["runtime_overhead_bytes"]), f"the {profile} datasheet profile"


def calibrate_ops(ops, settings: Settings, advance) -> tuple[dict, int]:
    """Forward/backward times of (op, key) pairs, by key; and how many ops were skipped."""
    from .ops import time_op
    times, skipped = {}, 0
    for op, key in ops:
        t = time_op(op, settings.device, settings.plan["repeats"], max_bytes=1 << 30)
        if t is None:
            skipped += 1
        else:
            times[key] = [t[0], t[1]]
        advance(op.target.removeprefix("aten.")[:26])
    return times, skipped


def run(name: str, settings: Settings, advance) -> dict:
    """Measure everything; ``advance(description)`` is called after each step."""
    plan, dev = settings.plan, settings.device
    # the collective workers (on a CPU) and the training workers (the host optimizer) share the cores so
    torch.set_num_threads(threads_per_worker(settings.nproc))
    products = []
    for dtype in settings.dtypes:
        for n in matmul_sizes(settings, dtype):
            products.append(bench.matmul(n, dtype, dev, plan["repeats"]))
            advance(f"matmul {n}^3 {products[-1]['dtype']}")
    grouped = bench.grouped_matmul(*GROUPED_MATMUL[dev], torch.bfloat16, dev, plan["repeats"])
    advance("grouped matmul")
    attention = []
    for shape in ATTENTION[dev]:
        attention.append(bench.attention(*shape, torch.bfloat16, dev, plan["repeats"]))
        advance(f"attention s={shape[2]}")
    memory = []
    for numel in plan["memory"]:
        memory.append(bench.memory_bandwidth(numel, dev, plan["repeats"]))
        advance("memory bandwidth")
    overhead = bench.op_overhead(dev, plan["repeats"])
    advance("op overhead")
    adam = bench.adam_rate(plan["adam"], "cpu", plan["repeats"])
    advance("optimizer step")
    host = bench.host_copies(plan["host_copy"], plan["repeats"]) if dev == "cuda" else []
    advance("host link")
    comm = []
    if settings.nproc > 1:
        comm = collectives.measure(settings.nproc, dev, plan["messages"], plan["repeats"],
                                   on_step=lambda op, g, b: advance(f"{op} x{g} {b} B"))
    return build_profile(name, settings, products, memory, overhead, adam, comm, host, grouped, attention)


def execution_facts(device: str) -> dict[str, bool]:
    """How training runs on the device (``DeviceProfile.fuses_memory_bound_ops`` and
    ``overlaps_communication``), which no micro-benchmark here measures: GPU training fuses
    memory-bound chains and NCCL communicates on its own streams; eager CPU kernels run one op at a
    time, and gloo reduces and copies on the cores that compute."""
    gpu = device == "cuda"
    return {"fuses_memory_bound_ops": gpu, "overlaps_communication": gpu}


def links(settings: Settings, comm: list[dict]) -> tuple[dict, dict, str]:
    """(intra-node, inter-node, where they come from): fitted to the measured collectives, or, with one
    device, copied from the datasheet profile ``settings.link_profile``."""
    if comm:
        link = link_of(comm)
        return link, dict(link), "measured (inter-node: not measurable on one host, recorded equal)"
    from ..cost.profile import load_profile_json
    if not settings.link_profile:
        raise ValueError("one device measures no collectives: a link profile must be named")
    data = load_profile_json(settings.link_profile)
    return data["intra_node"], data["inter_node"], f"copied from the {settings.link_profile} profile (one device)"


def over_curve(flops_per_s: float, flops: float, peak_flops_per_s: float, curve: list[tuple[float, float]]) -> float:
    """A measured rate over what the cost model gives a plain product of ``flops`` FLOPs: the peak times the measured
    curve there, interpolated in log10 FLOPs and held constant beyond its ends (``cost.ops.curve_efficiency``). The
    fraction the profile's ``grouped_matmul_efficiency`` and ``attention_efficiency`` hold."""
    return flops_per_s / (peak_flops_per_s * float(curve_efficiency(flops, curve)))


def grouped_efficiency(grouped: dict, peak_flops_per_s: float, curve: list[tuple[float, float]]) -> float:
    """``grouped_matmul_efficiency``: the grouped product's rate over a plain product's of one group's FLOPs."""
    return over_curve(grouped["flops_per_s"], grouped["group_flops"], peak_flops_per_s, curve)


def attention_curve(attention: list[dict], peak_flops_per_s: float,
                    curve: list[tuple[float, float]]) -> list[list[float]]:
    """``attention_efficiency``: per measured attention, (its forward FLOPs, its rate of work over a plain product's
    rate at those FLOPs)."""
    return sorted([a["forward_flops"], over_curve(a["flops_per_s"], a["forward_flops"], peak_flops_per_s, curve)]
                  for a in attention)


def build_profile(name: str, settings: Settings, products: list[dict], memory: list[dict], overhead: float,
                  adam: float, comm: list[dict], host_copies: list[dict] | None = None,
                  grouped: dict | None = None, attention: list[dict] | None = None) -> dict:
    peaks = {}
    for p in products:
        peaks[p["dtype"]] = max(peaks.get(p["dtype"], 0.0), p["flops_per_s"])
    reference = "bfloat16" if "bfloat16" in peaks else "float32"
    curve = sorted((p["flops"], min(1.0, p["flops_per_s"] / peaks[reference]))
                   for p in products if p["dtype"] == reference)
    mem_rate = max(m["bytes_per_s"] for m in memory)
    intra, inter, links_from = links(settings, comm)
    host_rate = min(c["bytes_per_s"] for c in host_copies) if host_copies else mem_rate
    overhead_bytes, overhead_from = runtime_overhead_bytes(settings.device, device_name(settings.device))
    return {
        "schema_version": 1, "kind": "tensoropt.device_profile", "name": name,
        "device": device_name(settings.device), "measured": True,
        "peak_flops": peaks, "matmul_efficiency": [list(p) for p in curve],
        "memory_bytes": memory_bytes(settings.device), "memory_bandwidth_bytes_per_s": mem_rate,
        "memory_efficiency": 1.0, "kernel_overhead_s": overhead, "runtime_overhead_bytes": overhead_bytes,
        # the cost model applies it to bf16 grouped products: measured against the bf16 curve (absent without one)
        **({"grouped_matmul_efficiency": grouped_efficiency(grouped, peaks[reference], curve)}
           if grouped and reference == grouped["dtype"] else {}),
        # and to fused attentions (measured in bf16, against the bf16 curve)
        **({"attention_efficiency": attention_curve(attention, peaks[reference], curve)}
           if attention and all(a["dtype"] == reference for a in attention) else {}),
        **execution_facts(settings.device),
        "intra_node": intra, "inter_node": inter,
        "host": {"pcie_bandwidth_bytes_per_s": host_rate, "cpu_adam_params_per_s": adam},
        "extrapolation": "efficiency is interpolated in log10(FLOPs) between measured products and held "
                         "constant beyond them; links follow the fitted ring model at every size",
        "sources": [f"measured by `tensoropt profile --device {settings.device} --nproc {settings.nproc}"
                    f"{' --quick' if settings.quick else ''}`"],
        "metadata": {
            "device_name": device_name(settings.device), "device_count": settings.nproc,
            "device_kind": settings.device, "host": socket.gethostname(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "quick": settings.quick, "threads_per_worker": torch.get_num_threads(), "links_from": links_from,
            "runtime_overhead_from": overhead_from,
            "host_link": "pinned host<->device copies, the slower direction" if host_copies else
                         "no host link on a CPU: the memory bandwidth",
            "method": "medians of timed samples after a warm-up (back-to-back calls between CUDA events on a GPU, "
                      "perf_counter on a CPU); collectives in worker processes of their own "
                      f"({'nccl' if settings.device == 'cuda' else 'gloo'}); links {links_from}",
        },
        "measurements": {"matmul": products, "grouped_matmul": [grouped] if grouped else [],
                         "attention": attention or [], "memory": memory,
                         "op_overhead_s": overhead,
                         "adam_params_per_s": adam, "collectives": comm, "host_copies": host_copies or []},
    }
