"""How the cost model prices a device whose training runtime neither fuses memory-bound ops nor
overlaps communication with compute (eager CPU kernels and gloo on the compute cores, as in
``profiles/cpu-2core.json``), and the model-state sizes per training precision."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import SMALL_GPT

import tensoropt
from tensoropt.cost.comm import _collective, collective_rows_s
from tensoropt.cost.model import ModelCost, estimate, state_bytes
from tensoropt.cost.ops import OpArrays, fused_bytes
from tensoropt.cost.profile import PROFILES_DIR, Cluster, DeviceProfile, available_profiles, load_profile
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small.json"
    path.write_text(json.dumps(SMALL_GPT))
    return tensoropt.capture(str(path)).graph


def _h100(**facts) -> DeviceProfile:
    return dataclasses.replace(load_profile("h100-80gb"), **facts)


def _plan(zero: int) -> Plan:
    return Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=8, zero=zero,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), SMALL_GPT["num_layers"]),)),))


def test_only_the_cpu_profile_says_its_runtime_neither_fuses_nor_overlaps():
    """Every profile in profiles/, one the user measured there too (README's `profile --out`): a CPU is known by
    the kind of device it was measured on, else by its name."""
    for name in available_profiles():
        profile = load_profile(name)
        kind = json.loads((PROFILES_DIR / f"{name}.json").read_text()).get("metadata", {}).get("device_kind")
        cpu = kind == "cpu" if kind else name.startswith("cpu")
        assert profile.fuses_memory_bound_ops is not cpu and profile.overlaps_communication is not cpu, name


def test_a_profile_that_omits_the_facts_reads_as_a_fusing_overlapping_device():
    data = json.loads((PROFILES_DIR / "cpu-2core.json").read_text())
    for key in ("fuses_memory_bound_ops", "overlaps_communication"):
        del data[key]
    profile = DeviceProfile.from_json(data)
    assert profile.fuses_memory_bound_ops and profile.overlaps_communication


@pytest.mark.parametrize("zero", [0, 3])
def test_a_device_that_does_not_overlap_pays_compute_plus_all_communication(graph, zero):
    folded = tensoropt.fold(graph)
    serial = estimate(ModelCost(graph, folded, Cluster(2, 2, _h100(overlaps_communication=False))), _plan(zero))
    hidden = estimate(ModelCost(graph, folded, Cluster(2, 2, _h100())), _plan(zero))
    parts = serial.time_breakdown
    assert parts["data_parallel_comm_s"] > 0
    assert parts["data_parallel_exposed_s"] == parts["data_parallel_comm_s"]
    assert serial.iteration_time_s == pytest.approx(parts["compute_s"] + parts["data_parallel_comm_s"]
                                                    + parts["optimizer_s"] + parts["gradient_accumulation_s"])
    assert hidden.time_breakdown["data_parallel_exposed_s"] < parts["data_parallel_comm_s"]
    assert hidden.iteration_time_s < serial.iteration_time_s
    assert hidden.peak_memory_bytes == serial.peak_memory_bytes          # a time fact, not a memory one


def test_eager_kernels_or_a_device_that_does_not_fuse_move_every_ops_bytes(graph):
    ops = tensoropt.fold(graph).blocks[0].ops
    fused = OpArrays.of(ops, _h100(), fused=True).activation_bytes
    eager = OpArrays.of(ops, _h100()).activation_bytes
    saved = fused_bytes(ops)
    assert saved.sum() > 0                                   # the block has chains a GPU would fuse
    np.testing.assert_allclose(eager - fused, saved)
    assert eager.sum() > fused.sum()
    # compiling changes nothing on a device whose profile says it does not fuse
    np.testing.assert_array_equal(OpArrays.of(ops, _h100(fuses_memory_bound_ops=False), fused=True).activation_bytes,
                                  eager)


def test_model_states_per_parameter_by_training_precision():
    fp32, mixed = state_bytes("float32"), state_bytes("bfloat16")
    # float32: the weights are the master copy, Adam keeps m and v (4 + 4 + 8)
    assert (fp32.weight, fp32.grad, fp32.optimizer) == (4, 4, 8)
    # mixed precision: 16-bit weights and gradients, float32 master copy, m and v (2 + 2 + 12, ZeRO's K = 12)
    assert (mixed.weight, mixed.grad, mixed.optimizer) == (2, 2, 12)
    assert state_bytes("float16") == mixed
    # a fused step reads weight, gradient, m, v and writes weight, m, v (float32); mixed also writes the bf16 copy
    assert fp32.adam_moved == 7 * 4 and mixed.adam_moved == 36
    # ZeRO 1-2 in float32 update a separate float32 partition of the weights
    assert [fp32.optimizer_bytes(z) for z in range(4)] == [8, 12, 12, 8]
    assert [mixed.optimizer_bytes(z) for z in range(4)] == [12] * 4
    # a bf16 model trained in bf16 (no master copy: what the torch engine runs): 2 + 2 + 4, step moves 7 x 2
    pure = state_bytes("bfloat16", master_weights=False)
    assert (pure.weight, pure.grad, pure.optimizer, pure.adam_moved) == (2, 2, 4, 14)
    assert [pure.optimizer_bytes(z) for z in range(4)] == [4, 6, 6, 4]
    assert state_bytes("float32", master_weights=True) == fp32          # float32 weights are their own master
    assert "no master copy (2 + 2 + 4 bytes)" in pure.precision and "(2 + 2 + 12 bytes)" in mixed.precision


def _cpu_cluster() -> Cluster:
    return Cluster(2, 2, load_profile("cpu-2core"))


def test_each_collective_runs_at_the_bandwidth_the_profile_measured_for_it():
    from tensoropt.cost.comm import all_gather_s, all_reduce_s, reduce_scatter_s
    cluster = _cpu_cluster()
    link = cluster.profile.intra_node
    nbytes, alpha = 64e6, link.latency_s
    assert all_reduce_s(nbytes, 2, 1, cluster) == pytest.approx(2 * (0.5 * nbytes / link.bandwidth_bytes_per_s + alpha))
    for collective, fn in (("all_gather", all_gather_s), ("reduce_scatter", reduce_scatter_s)):
        bandwidth = dict(link.collective_bandwidths)[collective]
        assert bandwidth < link.bandwidth_bytes_per_s / 2             # gloo's are slower than its all-reduce
        assert fn(nbytes, 2, 1, cluster) == pytest.approx(0.5 * nbytes / bandwidth + alpha)
        # sent as 5 collectives (layer by layer): the same volume, the latency paid 5 times
        assert fn(nbytes, 2, 1, cluster, units=5) - fn(nbytes, 2, 1, cluster) == pytest.approx(4 * alpha)


def test_a_link_without_per_collective_bandwidths_uses_its_own_for_all():
    link = load_profile("h100-80gb").intra_node
    assert link.collective_bandwidths == ()
    assert link.bytes_per_s("all_gather") == link.bytes_per_s("all_reduce") == link.effective_bytes_per_s


@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_stages_communicate_in_every_micro_batch(graph, zero):
    """ZeRO 2: a reduce-scatter per micro-batch and one all-gather of the updated weights; ZeRO 3:
    per micro-batch two all-gathers (forward, backward) and a reduce-scatter; each layer by layer
    (one unit per block copy and one for the loose ops) and through flat buffers."""
    from tensoropt.cost.comm import all_gather_s, reduce_scatter_s
    cluster = _cpu_cluster()
    model = ModelCost(graph, tensoropt.fold(graph), cluster)
    units = SMALL_GPT["num_layers"] + 1
    assert model.units_per_stage(1) == units
    comm = {}
    for micro_batches in (1, 4):
        plan = dataclasses.replace(_plan(zero), micro_batch=4 // micro_batches, dtype="float32")
        est = estimate(model, plan)
        weight_bytes = est.memory_breakdown["parameters_bytes"] * (2 if zero == 3 else 1)
        copy_s = 2 * weight_bytes / cluster.profile.memory_bytes_per_s
        gather = all_gather_s(weight_bytes, 2, 1, cluster, units) + copy_s
        scatter = reduce_scatter_s(weight_bytes, 2, 1, cluster, units) + copy_s
        per_step = micro_batches * (2 * gather + scatter) if zero == 3 else micro_batches * scatter + gather
        assert est.time_breakdown["data_parallel_comm_s"] == pytest.approx(per_step)
        comm[micro_batches] = est.time_breakdown["data_parallel_comm_s"]
    assert comm[4] > 3 * comm[1] if zero == 3 else comm[4] > 2 * comm[1]


@pytest.mark.parametrize("profile", ["h100-80gb", "cpu-2core"])
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter"])
def test_collectives_priced_per_row_equal_the_one_group_prices(profile, collective):
    """The search prices every plan's data-parallel collectives in one pass over its rows
    (``comm.collective_rows_s``): each row's price is exactly the one-group price (``_collective``) of its group's
    size and stride, in a node or across nodes, one unit or several, nothing to send or one rank."""
    cluster = Cluster(256, 8, load_profile(profile))
    shapes = [(size, stride, units) for size in (1, 2, 3, 4, 8, 16, 64) for stride in (1, 2, 4, 8, 16)
              for units in (1, 5)]
    nbytes = np.array([0.0 if k % 7 == 0 else 1e6 * (k + 1) for k in range(len(shapes))])
    size, stride, units = (np.array(column) for column in zip(*shapes))
    rows = collective_rows_s(nbytes, size, stride, cluster, collective, units)
    one = [_collective(b, s, t, cluster, collective, u) for b, (s, t, u) in zip(nbytes, shapes)]
    assert rows.tolist() == [float(x) for x in one]
