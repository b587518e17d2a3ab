"""Pricing keyed on the kernels a plan runs (issue 19): eager PyTorch (one kernel per op, the torch engine
today) or compiled blocks (memory-bound chains fused), and FSDP2's unit-by-unit overlap of ZeRO 3."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import SMALL_GPT

import tensoropt
from tensoropt.cost.data_parallel import fsdp_exposed_s
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small.json"
    path.write_text(json.dumps(SMALL_GPT))
    graph = tensoropt.capture(str(path)).graph
    return ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb")))


def _plan(compile: bool, zero: int = 3) -> Plan:
    return Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=8, zero=zero, compile=compile,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), SMALL_GPT["num_layers"]),)),))


def test_a_compiled_plan_is_priced_with_fused_kernels_and_an_eager_one_without(model):
    eager, compiled = estimate(model, _plan(False)), estimate(model, _plan(True))
    assert compiled.time_breakdown["forward_backward_s"] < eager.time_breakdown["forward_backward_s"]
    # the same numbers as a model built for that kernel mode from the start
    fresh = ModelCost(model.graph, model.folded, model.cluster, compiled=True)
    assert estimate(fresh, _plan(True)).iteration_time_s == compiled.iteration_time_s
    assert estimate(fresh, _plan(False)).iteration_time_s == eager.iteration_time_s
    assert compiled.peak_memory_bytes == eager.peak_memory_bytes       # a time fact, not a memory one


def test_plan_json_says_which_kernels_and_old_plans_load_as_eager():
    plan = _plan(True)
    data = plan.to_json()
    assert data["compile"] is True and "compiled" in data["summary"]
    assert Plan.from_json(data) == plan
    del data["compile"]
    assert Plan.from_json(data) == dataclasses.replace(plan, compile=False)


def test_fsdp2_exposes_the_first_gather_and_the_last_reduce_scatter_and_what_outruns_compute():
    # 4 units, gathers of 1 s and reduce-scatters of 2 s in all: 0.25 and 0.5 per unit
    units = np.array([4])
    # compute long enough to hide every other collective: only the first gather and the last scatter show
    np.testing.assert_allclose(fsdp_exposed_s(1.0, 2.0, np.array([8.0]), np.array([8.0]), units), [0.75])
    # a backward of 0.5 s per unit cannot hide a gather + scatter of 0.75 s: 0.25 s more for 3 of the units;
    # a forward of 0.1 s per unit leaves 0.15 s of each of the 3 later gathers
    np.testing.assert_allclose(fsdp_exposed_s(1.0, 2.0, np.array([0.4]), np.array([2.0]), units),
                               [0.75 + 3 * 0.15 + 3 * 0.25])


def test_the_torch_engines_adamw_step_is_priced_as_the_foreach_passes_it_runs():
    from tensoropt.cost.model import state_bytes
    # eight foreach passes over float32 lists (torch/optim/adam.py _multi_tensor_adam): 80 bytes per parameter,
    # against 28 for a fused step (DeepSpeed's mixed precision: read w, g, m, v, write w, m, v and the bf16 copy)
    for zero in range(4):
        assert state_bytes("bfloat16", False, "bf16-mixed", zero).adam_moved == 80
    assert state_bytes("bfloat16", True, "bf16-mixed").adam_moved == 36


def test_zero1_hides_its_reduce_scatter_behind_the_backward_and_its_gather_behind_the_forward():
    from tensoropt.cost.comm import all_reduce_s
    from tensoropt.cost.data_parallel import data_parallel_s
    cluster = Cluster(16, 8, load_profile("h100-80gb"))
    grad = 4e9                                                       # bytes of gradients, priced across 2 nodes
    volume = all_reduce_s(grad, 16, 1, cluster)
    stage, back = np.array([volume, volume]), np.array([0.3 * volume, 0.3 * volume])  # forward 0.7, backward 0.3
    comm, exposed = data_parallel_s(np.array([16, 16]), np.array([1, 1]), np.array([0, 1]), np.array([1, 1]),
                                    np.array([grad, grad]), np.array([grad, grad]), stage, back, cluster,
                                    np.array([5, 5]))
    np.testing.assert_allclose(comm, [volume, volume])
    slow = cluster.profile.overlap_slowdown
    ddp = 0.7 * volume                                               # all of it behind the backward: 0.3 hidden
    zero1 = 0.2 * volume                                             # half behind the backward, half behind the forward
    np.testing.assert_allclose(exposed, [ddp + slow * 0.3 * volume, zero1 + slow * 0.8 * volume])


def _tp_plan(tp: int) -> Plan:
    return Plan(devices=2, dp=2 // tp, tp=tp, pp=1, micro_batch=2, global_batch=4, zero=0, compile=True,
                tp_branches=("attn", "mlp") if tp > 1 else (),
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), SMALL_GPT["num_layers"]),)),))


def test_megatron_tp_comm_overlap_hides_the_tp_collectives_less_the_overlap_slowdown(model):
    """The estimate-only option for published Megatron-LM runs (--tp-comm-overlap): each copy's TP collectives
    hide behind its compute, less the profile's overlap_slowdown (0.2 on h100-80gb) of them."""
    plain, overlapped = estimate(model, _tp_plan(2)), estimate(model, _tp_plan(2), megatron_tp_comm_overlap=True)
    comm = plain.time_breakdown["tensor_parallel_comm_s"]
    assert comm > 0 and comm < plain.time_breakdown["forward_backward_s"]      # all of it fits beside compute
    hidden = overlapped.time_breakdown["tensor_parallel_hidden_s"]
    assert hidden == pytest.approx((1 - model.cluster.profile.overlap_slowdown) * comm, rel=1e-9)
    # dp 1: no data-parallel term depends on the stage time, so the step shrinks by exactly what hides
    assert plain.iteration_time_s - overlapped.iteration_time_s == pytest.approx(hidden, rel=1e-9)
    # without tensor parallelism there is nothing to hide
    assert estimate(model, _tp_plan(1), megatron_tp_comm_overlap=True).iteration_time_s == \
        estimate(model, _tp_plan(1)).iteration_time_s
