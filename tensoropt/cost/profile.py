"""Device profiles (versioned JSON in ``profiles/``) and clusters built from them."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import TensorOptError

PROFILE_SCHEMA_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


class ProfileError(TensorOptError):
    """A device profile that cannot be found or read."""


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_s: float     # per GPU, one direction
    latency_s: float
    efficiency: float = 1.0          # achieved fraction of the link rate for collectives
    # Ring bandwidth a collective reaches where it differs from all-reduce's (the fitted ``bandwidth``):
    # gloo's all-gather and reduce-scatter into fresh tensors reach a third of its all-reduce rate on
    # the CPU. (collective, bytes/s) pairs, measured by ``tensoropt profile``; absent for datasheet GPUs,
    # whose NCCL ring collectives reach about the same bus bandwidth.
    collective_bandwidths: tuple[tuple[str, float], ...] = ()
    # Peers each GPU's links are wired to directly, split evenly (no switch): a 4-GPU Hopper board (HGX 4-GPU,
    # H200 NVL with its 4-way bridge) gives each of its 3 peers 6 of the 18 NVLinks (``nvidia-smi topo -m``: NV6).
    # 0 for a switched fabric (NVSwitch, a NIC into a switch), where any group reaches the GPU's whole rate.
    direct_peers: int = 0

    @property
    def effective_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def share(self, members):
        """Fraction of the GPU's link rate a group of ``members`` GPUs on these links reaches (a number or a numpy
        array): all of it through a switch; over direct wiring, the links to the group's other members only, (m - 1)
        of ``direct_peers`` (rings over a full mesh use every link between the members: NCCL's rings on a 4-GPU board,
        each GPU sending on its links to all three peers at once)."""
        if not self.direct_peers:
            return 1.0
        return np.minimum(1.0, np.maximum(np.asarray(members, dtype=float) - 1.0, 1.0) / self.direct_peers)

    def bytes_per_s(self, collective: str) -> float:
        """Achieved ring bandwidth of one collective (``all_gather``, ``reduce_scatter``, ...)."""
        return dict(self.collective_bandwidths).get(collective, self.effective_bytes_per_s)

    @staticmethod
    def from_json(d: dict) -> Link:
        by_collective = d.get("collective_bandwidths_bytes_per_s", {})
        peers = d.get("direct_peers", 0)
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 0:      # JSON true is no count
            raise ValueError(f"direct_peers must be a whole number >= 0 (0: a switched fabric), got {peers!r}")
        return Link(float(d["bandwidth_bytes_per_s"]), float(d["latency_s"]), float(d.get("efficiency", 1.0)),
                    tuple(sorted((k, float(v)) for k, v in by_collective.items())), peers)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    device: str
    peak_flops: tuple[tuple[str, float], ...]
    matmul_efficiency: tuple[tuple[float, float], ...]   # (FLOPs of one product, fraction of peak)
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    memory_efficiency: float
    intra_node: Link
    inter_node: Link
    pcie_bandwidth_bytes_per_s: float
    cpu_adam_params_per_s: float
    kernel_overhead_s: float
    runtime_overhead_bytes: int
    measured: bool = False
    sources: tuple[str, ...] = ()
    op_times: tuple[tuple[str, float, float], ...] = ()    # (Op.key(), forward_s, backward_s) at batch 1
    # How the device's training runtime executes, which the roofline alone cannot know (see profiles/README.md):
    # GPU training fuses chains of memory-bound ops (Megatron-LM's fused kernels, torch.compile); eager CPU
    # kernels run one by one, each reading and writing its tensors.
    fuses_memory_bound_ops: bool = True
    # GPU collectives run on their own engines/streams beside compute (NCCL), so gradient communication hides
    # behind the backward; gloo on a CPU reduces and copies on the very cores that compute, so it cannot.
    overlaps_communication: bool = True
    # Fraction of a collective's time that the compute it overlaps loses (NCCL kernels take SMs and memory
    # bandwidth from the compute kernels beside them); fitted per GPU profile, 0 where unknown.
    overlap_slowdown: float = 0.0
    # Fraction of a plain product's efficiency (``efficiency`` at the FLOPs of one group's product) that the device's
    # grouped-product kernel (``torch._grouped_mm``, Mixture-of-Experts layers) reaches, > 1 where running the groups
    # together fills the device better than one group's product alone (the product is capped at 1); 1 where unknown.
    grouped_matmul_efficiency: float = 1.0
    # Fraction of a plain product's efficiency (``efficiency`` at the same FLOPs) that the device's fused attention
    # kernel (``scaled_dot_product_attention``: flash / memory-efficient / cuDNN, forward and backward) reaches on the
    # work it does (a causal kernel's tiles on and below the diagonal: ``cost.ops.causal_fraction``), as (forward
    # FLOPs, fraction) points interpolated in log10 FLOPs like the matmul curve; FLOPs counted as the graph counts them
    # (4 b h s_q s_k d forward, causal masking not discounted, ``graph.opinfo``). Measured by the profiler; 1 where
    # unknown (the attention's work then runs at the matmul curve's rate).
    attention_efficiency: tuple[tuple[float, float], ...] = ((1.0, 1.0),)
    # Fraction of the memory bandwidth a large contiguous copy reaches (one read and one write of the tensor, as
    # STREAM's Copy measures it): FSDP's and DeepSpeed's flat-buffer copies and the layout copies around torch's
    # sequence-dim collectives (``cost.tp_copies``). 0: unknown, the memory-bound ops' ``memory_efficiency`` then.
    copy_efficiency: float = 0.0

    @cached_property
    def attention_measured(self) -> bool:
        """Whether attention is priced off the matmul curve (a measured ``attention_efficiency``)."""
        return any(factor != 1.0 for _, factor in self.attention_efficiency)

    @cached_property
    def _op_table(self) -> dict[str, tuple[float, float]]:
        return {key: (fwd, bwd) for key, fwd, bwd in self.op_times}

    @cached_property
    def sharded_degrees(self) -> tuple[int, ...]:
        """Tensor-parallel degrees some op was measured at (keys ``...@tpN``)."""
        return tuple(sorted({int(k.rsplit("@tp", 1)[1]) for k, _, _ in self.op_times if "@tp" in k}))

    def op_time(self, key: str) -> tuple[float, float] | None:
        """Measured (forward_s, backward_s) of an op, if the profiler timed it."""
        return self._op_table.get(key)

    def peak(self, dtype: str) -> float:
        table = dict(self.peak_flops)
        return table.get(dtype) or table.get("bfloat16") or max(table.values())

    def efficiency(self, flops: float) -> float:
        """Fraction of peak a product of ``flops`` FLOPs reaches: piecewise linear in log10(flops)
        between the profile's points, constant beyond the first and the last."""
        xs = [math.log10(f) for f, _ in self.matmul_efficiency]
        ys = [e for _, e in self.matmul_efficiency]
        x = math.log10(max(flops, 1.0))
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_efficiency

    @property
    def copy_bytes_per_s(self) -> float:
        """Bytes a large contiguous copy reads (and as many it writes) per second."""
        return self.memory_bandwidth_bytes_per_s * (self.copy_efficiency or self.memory_efficiency)

    @staticmethod
    def from_json(data: dict) -> DeviceProfile:
        if data.get("kind") != "tensoropt.device_profile" or data.get("schema_version") != PROFILE_SCHEMA_VERSION:
            raise ValueError(f"not a device profile of schema_version {PROFILE_SCHEMA_VERSION}")
        curve = tuple(sorted((float(f), float(e)) for f, e in data["matmul_efficiency"]))
        if not curve or any(not 0 < e <= 1 for _, e in curve):
            raise ValueError("matmul_efficiency needs points with efficiencies in (0, 1]")
        return DeviceProfile(
            name=data["name"], device=data["device"],
            peak_flops=tuple(sorted((k, float(v)) for k, v in data["peak_flops"].items())),
            matmul_efficiency=curve, memory_bytes=int(data["memory_bytes"]),
            memory_bandwidth_bytes_per_s=float(data["memory_bandwidth_bytes_per_s"]),
            memory_efficiency=float(data["memory_efficiency"]),
            intra_node=Link.from_json(data["intra_node"]), inter_node=Link.from_json(data["inter_node"]),
            pcie_bandwidth_bytes_per_s=float(data["host"]["pcie_bandwidth_bytes_per_s"]),
            cpu_adam_params_per_s=float(data["host"]["cpu_adam_params_per_s"]),
            kernel_overhead_s=float(data["kernel_overhead_s"]),
            runtime_overhead_bytes=int(data["runtime_overhead_bytes"]),
            measured=bool(data.get("measured", False)), sources=tuple(data.get("sources", ())),
            op_times=tuple((k, float(v[0]), float(v[1])) for k, v in sorted(data.get("op_times", {}).items())),
            fuses_memory_bound_ops=bool(data.get("fuses_memory_bound_ops", True)),
            overlaps_communication=bool(data.get("overlaps_communication", True)),
            overlap_slowdown=float(data.get("overlap_slowdown", 0.0)),
            grouped_matmul_efficiency=_positive(data.get("grouped_matmul_efficiency", 1.0),
                                                "grouped_matmul_efficiency"),
            copy_efficiency=_positive(data["copy_efficiency"], "copy_efficiency") if "copy_efficiency" in data else 0.0,
            attention_efficiency=tuple(sorted((_positive(f, "attention_efficiency FLOPs"),
                                               _positive(e, "attention_efficiency"))
                                              for f, e in data.get("attention_efficiency", [[1.0, 1.0]]))) or
            ((1.0, 1.0),),
        )


def _positive(value, name: str) -> float:
    if not float(value) > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile_json(spec: str) -> dict:
    """A profile's JSON, by name (``h100-80gb``, looked up in ``profiles/``) or by path to a JSON file."""
    path = Path(spec)
    if not path.suffix:
        path = PROFILES_DIR / f"{spec}.json"
    if not path.is_file():
        raise ProfileError(f"unknown device profile {spec!r}: use one of {', '.join(available_profiles())} "
                           "or a path to a profile JSON file")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{path}: not a valid device profile ({exc})") from exc


def load_profile(spec: str) -> DeviceProfile:
    """A profile by name (``h100-80gb``, looked up in ``profiles/``) or by path to a JSON file."""
    data = load_profile_json(spec)
    try:
        return DeviceProfile.from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ProfileError(f"{spec}: not a valid device profile ({exc})") from exc


@dataclass(frozen=True)
class Cluster:
    """``num_devices`` identical devices, ``devices_per_node`` per node."""

    num_devices: int
    devices_per_node: int
    profile: DeviceProfile

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.devices_per_node < 1:
            raise TensorOptError(f"--gpus ({self.num_devices}) and --gpus-per-node ({self.devices_per_node}) "
                                 "must be positive")
        peers = self.profile.intra_node.direct_peers
        if peers and self.devices_per_node > peers + 1:
            raise TensorOptError(f"--gpus-per-node {self.devices_per_node} is more than profile {self.profile.name}'s "
                                 f"nodes hold: its GPUs are wired directly to {peers} peers each (intra_node."
                                 f"direct_peers); use --gpus-per-node {peers + 1} or less, or a switched profile")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise TensorOptError(f"--gpus {self.num_devices} is not a multiple of --gpus-per-node "
                                 f"{self.devices_per_node}; use whole nodes")

    @property
    def nodes(self) -> int:
        return max(1, self.num_devices // self.devices_per_node)
