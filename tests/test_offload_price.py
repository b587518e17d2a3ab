"""The optimizer step under DeepSpeed's optimizer offload, priced as DeepSpeed 0.19.8 runs it (``cost.model.
offload_step_s``): float32 gradients to the host, torch's AdamW there, a host cast of the updated partition into a
pinned buffer of the weights' dtype, and that buffer back to the device."""

import dataclasses
import json

import pytest
from conftest import SMALL_GPT

import tensoropt
from tensoropt.cost.model import HOST_ADAM_BYTES, ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small.json"
    path.write_text(json.dumps(SMALL_GPT))
    return tensoropt.capture(str(path)).graph


def _optimizer_s(graph, precision: str, **host) -> tuple[float, float]:
    """(optimizer seconds, bytes of the weights on the device) of a one-device ZeRO 1 offload plan on h100-80gb with
    ``host`` facts."""
    profile = dataclasses.replace(load_profile("h100-80gb"), **host)
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(1, 8, profile))
    plan = Plan(devices=1, dp=1, tp=1, pp=1, micro_batch=2, global_batch=4, zero=1, offload=True,
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
