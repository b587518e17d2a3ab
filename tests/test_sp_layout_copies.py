"""Sequence parallelism on a batch-first stream, and the copies around tensor-parallel collectives (issue 35): torch's
functional collectives gather and scatter along dim 0, so a reduce-scatter along the sequence (dim 1) first
concatenates its input's chunks, and an all-gather moves the ranks' shares from dim 0 to dim 1, a view only where the
batch dim is 1. Our eager runtime gathers each sample on views of one buffer, coalesced, and reduce-scatters on a
view at batch 1 and on the concatenated chunks past it (``runtime.parallel.sequence_collectives``); compiled blocks
trace torch's redistribution, and torch's own styles (``Runtime.TORCH_STYLES``: torchtitan's, KempnerForge's
runtimes) copy eagerly too. Megatron-LM's sequence-first stream needs none (``Runtime.MEGATRON``). Without sequence
parallelism our runtime and Megatron-LM sum in place; torch's styles copy twice per sharded branch."""

import dataclasses
import json

import pytest
import torch
from conftest import SMALL_GPT

import tensoropt
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.cost.runtimes import Runtime
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

SP = LayerStrategy("none", sequence_parallel=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small.json"
    path.write_text(json.dumps(SMALL_GPT))
    graph = tensoropt.capture(str(path)).graph
    cluster = Cluster(2, 2, load_profile("h100-80gb"))
    folded = tensoropt.fold(graph)
    return tuple(ModelCost(graph, folded, cluster, runtime=runtime)
                 for runtime in (Runtime.OURS, Runtime.MEGATRON, Runtime.TORCH_STYLES))


def _copy_s(nbytes: float, profile) -> float:
    """One copy: the tensor read and written once at the profile's copy rate, one kernel."""
    return 2 * nbytes / profile.copy_bytes_per_s + profile.kernel_overhead_s


def test_the_copy_rate_is_streams_fraction_of_the_bandwidth_where_the_profile_gives_one():
    h100, a100 = load_profile("h100-80gb"), load_profile("a100-80gb")
    assert h100.copy_bytes_per_s == pytest.approx(0.91 * h100.memory_bandwidth_bytes_per_s)
    assert a100.copy_efficiency == 0.0 and a100.copy_bytes_per_s == a100.memory_bytes_per_s


@pytest.mark.parametrize("micro_batch", [1, 2, 4])
def test_torchs_redistribution_pays_a_copy_per_reduce_scatter_and_per_gather_past_batch_one_and_ours_its_scatters(
        models, micro_batch):
    ours, megatron, torchs = (m.blocks[0][1] for m in models)
    branches = models[0].branch_names
    profile = models[0].cluster.profile
    layers = [cost.layer(SP, 2, branches, micro_batch) for cost in (ours, megatron, torchs)]
    scatters = sum(2 * _copy_s(ours._branch_nbytes[b] * micro_batch, profile) for b in ours.space.branches)
    gathers = scatters + sum(_copy_s(ours._gathered_nbytes[b] * micro_batch, profile) for b in ours.space.branches)
    # our eager copy gathers every sample on views (runtime.parallel.sequence_collectives) and reduce-scatters on a
    # view at batch 1, on the concatenated chunks past it
    assert layers[0].tp_comm_s - layers[1].tp_comm_s == pytest.approx(
        scatters if micro_batch > 1 else 0.0, rel=1e-12, abs=1e-15)
    assert ours.sp_copies_s(2, branches, micro_batch)[1] == 0.0          # the backward's gathers again: on views
    # torch's styles: reduce-scatters concatenate at any batch, gathers copy past batch 1
    assert layers[2].tp_comm_s - layers[1].tp_comm_s == pytest.approx(
        scatters + (gathers if micro_batch > 1 else 0.0), rel=1e-12, abs=1e-15)
    # compiled blocks trace torch's redistribution: the same copies
    compiled = models[0].with_kernels(True).blocks[0][1]
    assert sum(compiled.sp_copies_s(2, branches, micro_batch)) == pytest.approx(
        scatters + (gathers if micro_batch > 1 else 0.0), rel=1e-12)
    change = ours.space.carried_bytes * micro_batch
    assert ours.layout_change_s(2, micro_batch) == megatron.layout_change_s(2, micro_batch)
    for redistributing in (compiled, torchs):
        assert redistributing.layout_change_s(2, micro_batch) - megatron.layout_change_s(2, micro_batch) == \
            pytest.approx(_copy_s(change, profile) if micro_batch > 1 else 0.0, rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_without_sequence_parallelism_torchs_styles_copy_twice_a_branch_and_ours_none(models, recompute):
    """torch's ``RowwiseParallel`` sums each sharded branch's output with a functional all-reduce, and
    ``ColwiseParallel``'s input its gradient, each cloning its input: two copies per branch, the forward's again in a
    full recomputation. Our runtime sums both in place, as Megatron-LM does: none; compiled blocks none either."""
    ours, megatron, torchs = (m.blocks[0][1] for m in models)
    branches, profile = models[0].branch_names, models[0].cluster.profile
    plain = LayerStrategy(recompute)
    layers = [cost.layer(plain, 2, branches, 4) for cost in (ours, megatron, torchs)]
    assert layers[0].tp_comm_s == layers[1].tp_comm_s and layers[0].recompute_s == layers[1].recompute_s
    one_each = sum(_copy_s(ours._branch_nbytes[b] * 4, profile) for b in ours.space.branches)
    assert layers[2].tp_comm_s - layers[0].tp_comm_s == pytest.approx(2 * one_each, rel=1e-12)
    assert layers[2].recompute_s - layers[0].recompute_s == pytest.approx(one_each if recompute == "full" else 0.0,
                                                                          rel=1e-9, abs=1e-15)
    compiled = models[2].with_kernels(True).blocks[0][1]
    assert compiled.reduce_copies_s(2, branches, 4) == 0.0 and compiled.runtime is Runtime.TORCH_STYLES
    assert ours.reduce_copies_s(2, branches, 4) == 0.0
    assert ours.layer(SP, 1, (), 4).tp_comm_s == 0.0


def test_at_batch_one_torchs_styles_still_concatenate_for_their_reduce_scatters(models):
    ours, _, torchs = (m.blocks[0][1] for m in models)
    branches, profile = models[0].branch_names, models[0].cluster.profile
    assert ours.sp_copies_s(2, branches, 1) == (0.0, 0.0)
    scatters = sum(2 * _copy_s(ours._branch_nbytes[b], profile) for b in ours.space.branches)
    assert torchs.sp_copies_s(2, branches, 1) == (pytest.approx(scatters, rel=1e-12), 0.0)


def test_a_full_recomputation_recomputes_the_forwards_copies_too(models):
    _, megatron, torchs = (m.blocks[0][1] for m in models)
    branches = models[0].branch_names
    full = LayerStrategy("full", sequence_parallel=True)
    copied, plain = torchs.layer(full, 2, branches, 2), megatron.layer(full, 2, branches, 2)
    copies = torchs.sp_copies_s(2, branches, 2)[0]
    assert copies > 0 and copied.recompute_s - plain.recompute_s == pytest.approx(copies / 2, rel=1e-12)


def test_the_estimate_of_a_sequence_parallel_plan_carries_its_runtimes_copies(models):
    ours, megatron, torchs = models
    plan = Plan(devices=2, dp=1, tp=2, pp=1, micro_batch=2, global_batch=4, tp_branches=ours.branch_names,
                blocks=(BlockPlan("layers.*", ((SP, SMALL_GPT["num_layers"]),)),))
    a, b, c = estimate(ours, plan), estimate(megatron, plan), estimate(torchs, plan)
    # Megatron-LM's products sum the micro-batches' gradients themselves (``cost.accumulation``): that pass apart
    summed = a.time_breakdown["gradient_accumulation_s"]
    assert summed > 0 and b.time_breakdown["gradient_accumulation_s"] == 0.0
    assert c.iteration_time_s > a.iteration_time_s > b.iteration_time_s + summed
    assert a.peak_memory_bytes == b.peak_memory_bytes == c.peak_memory_bytes
    compiled = ours.with_kernels(True)
    assert compiled.runtime is Runtime.OURS and megatron.with_kernels(True).runtime is Runtime.MEGATRON
    assert estimate(compiled, dataclasses.replace(plan, compile=True)).iteration_time_s > \
        estimate(megatron.with_kernels(True), dataclasses.replace(plan, compile=True)).iteration_time_s


def test_torch_gathers_along_the_sequence_with_a_copy_only_past_batch_one_and_always_scatters_with_one():
    """What the price relies on, in torch's own helpers (``torch._utils``): the all-gather's dim-0 result of tp ranks'
    [b, s/tp, h] shares becomes [b, s, h] as a view when b is 1 and by a copy otherwise; the reduce-scatter's input
    [b, s, h] is rearranged into [tp * b, s/tp, h] by a concatenation, always a new tensor."""
    from torch._utils import _chunk_or_narrow_cat, _maybe_view_chunk_cat
    tp, seq, hidden = 2, 8, 4
    for batch in (1, 3):
        gathered = torch.arange(tp * batch * (seq // tp) * hidden, dtype=torch.float32).reshape(
            tp * batch, seq // tp, hidden)
        whole = _maybe_view_chunk_cat(gathered, tp, 1)
        assert whole.shape == (batch, seq, hidden)
        assert (whole.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()) == (batch == 1)
        assert torch.equal(whole, torch.cat(torch.chunk(gathered, tp, dim=0), dim=1))
        stream = torch.randn(batch, seq, hidden)
        ready = _chunk_or_narrow_cat(stream, tp, narrow_dim=1, cat_dim=0)
        assert ready.shape == (tp * batch, seq // tp, hidden)
        assert ready.untyped_storage().data_ptr() != stream.untyped_storage().data_ptr()


def test_fsdp_flat_buffer_copies_run_at_the_copy_rate(models):
    """ZeRO 3 / FSDP2 copies each unit's weights into and out of its flat buffers around the collectives: large
    contiguous copies, at the profile's copy rate (STREAM's fraction on the H100), not the memory-bound ops' rate."""
    from tensoropt.cost.comm import all_gather_s, reduce_scatter_s
    model = ModelCost(models[0].graph, models[0].folded, Cluster(2, 2, load_profile("h100-80gb")))
    plan = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=4, zero=3,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), SMALL_GPT["num_layers"]),)),))
    est = estimate(model, plan)
    profile, units = model.cluster.profile, model.units_per_stage(1)
    weights = est.memory_breakdown["parameters_bytes"] * 2
    copy = 2 * weights / profile.copy_bytes_per_s
    assert profile.copy_bytes_per_s > 1.5 * profile.memory_bytes_per_s
    gather = all_gather_s(weights, 2, 1, model.cluster, units) + copy
    scatter = reduce_scatter_s(weights, 2, 1, model.cluster, units) + copy
    assert est.time_breakdown["data_parallel_comm_s"] == pytest.approx(2 * gather + scatter, rel=1e-9)
