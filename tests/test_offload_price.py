"""The optimizer step under DeepSpeed's optimizer offload, priced as DeepSpeed 0.19.8 runs it (``cost.offload``):
float32 gradients to the host, torch's AdamW there, a host cast of the updated partition into a
pinned buffer of the weights' dtype, and that buffer back to the device; before it, the micro-batches' running
sum of the gradients moves between the device and the host (``cost.offload.gradient_copies``), counted here in a
real DeepSpeed run."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_GPT

import tensoropt
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.offload import HOST_ADAM_BYTES, gradient_copies
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small.json"
    path.write_text(json.dumps(SMALL_GPT))
    return tensoropt.capture(str(path)).graph


def _optimizer_s(graph, precision: str, zero: int = 1, micro_batches: int = 2, **host) -> tuple[float, float]:
    """(optimizer seconds, bytes of the weights on the device) of a one-device offload plan on h100-80gb with
    ``host`` facts."""
    profile = dataclasses.replace(load_profile("h100-80gb"), **host)
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(1, 8, profile))
    plan = Plan(devices=1, dp=1, tp=1, pp=1, micro_batch=2, global_batch=2 * micro_batches, zero=zero, offload=True,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), SMALL_GPT["num_layers"]),)),),
                master_weights=precision == "bf16-mixed", precision=precision)
    est = estimate(model, plan)
    return est.time_breakdown["optimizer_s"], est.memory_breakdown["parameters_bytes"]


@pytest.mark.parametrize("precision, weight_bytes", [("bf16-mixed", 2), ("32-true", 4)])
def test_the_link_carries_float32_gradients_down_and_the_weights_up(graph, precision, weight_bytes):
    """Halving the host link's time (twice the bandwidth) saves half of (4 + weight bytes) per parameter over it."""
    slow, weights = _optimizer_s(graph, precision, pcie_bandwidth_bytes_per_s=10e9, cpu_adam_params_per_s=1e9)
    params = weights / weight_bytes
    fast, _ = _optimizer_s(graph, precision, pcie_bandwidth_bytes_per_s=20e9, cpu_adam_params_per_s=1e9)
    assert slow - fast == pytest.approx((4 + weight_bytes) * params / 20e9, rel=1e-9)


def test_the_host_runs_adamw_and_the_cast_at_its_adamw_rate(graph):
    """The host's share is AdamW's 80 bytes per parameter plus the cast's 4 read + 2 written, at the profile's rate."""
    slow, weights = _optimizer_s(graph, "bf16-mixed", pcie_bandwidth_bytes_per_s=1e12, cpu_adam_params_per_s=0.5e9)
    params = weights / 2
    fast, _ = _optimizer_s(graph, "bf16-mixed", pcie_bandwidth_bytes_per_s=1e12, cpu_adam_params_per_s=1e9)
    assert slow - fast == pytest.approx(params * (1 + 6 / HOST_ADAM_BYTES) / 1e9, rel=1e-9)


@pytest.mark.parametrize("zero, micro_batches, copies", [(1, 4, 0), (2, 1, 0), (2, 4, 7), (3, 1, 2), (3, 4, 8)])
def test_the_link_also_carries_the_running_sum_of_the_micro_batches(graph, zero, micro_batches, copies):
    """Beyond the step's own traffic, ZeRO 2 moves the bf16 gradients 2m - 1 times over the host link when there is
    more than one micro-batch, ZeRO 3 2m times, ZeRO 1 never."""
    slow, weights = _optimizer_s(graph, "bf16-mixed", zero, micro_batches, pcie_bandwidth_bytes_per_s=10e9,
                                 cpu_adam_params_per_s=1e9)
    fast, _ = _optimizer_s(graph, "bf16-mixed", zero, micro_batches, pcie_bandwidth_bytes_per_s=20e9,
                           cpu_adam_params_per_s=1e9)
    params = graph.num_parameters
    assert gradient_copies(zero, micro_batches) == copies
    assert slow - fast == pytest.approx((4 + 2 + copies * 2) * params / 20e9, rel=1e-9)


@pytest.mark.slow
def test_deepspeed_copies_the_running_sum_as_priced():
    """A real DeepSpeed rank (the config tensoropt writes, bf16-mixed, optimizer offloaded) counted by a dispatch
    mode: the bytes its second step copies into or out of its host gradient buffers. ZeRO 1 and 2 take the path a
    GPU takes. ZeRO 3 on CPU copies only the first micro-batch's partition: DeepSpeed's CPU accelerator counts the
    host buffer as on the device and adds the later ones in place (``stage3.py`` ``partition_grads``: on a GPU each
    micro-batch copies out and back, which is what ``gradient_copies`` prices)."""
    probe = Path(__file__).parent / "offload_copies_probe.py"
    out = subprocess.run([sys.executable, probe, "1:3", "2:1", "2:3", "3:3"], check=True, capture_output=True,
                         text=True, timeout=600)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"1:3": gradient_copies(1, 3), "2:1": gradient_copies(2, 1), "2:3": gradient_copies(2, 3),
                    "3:3": 1}
