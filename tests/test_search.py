"""Frontier-tracking search: equal to exhaustive enumeration, folded equal to unfolded, and every
frontier point priced exactly as `estimate` prices its plan."""

import numpy as np
import pytest

import tensoropt
from tensoropt.cost.model import Context, ModelCost, estimate, evaluate
from tensoropt.cost.profile import PROFILES_DIR, Cluster, load_profile
from tensoropt.search.exhaustive import exhaustive_search
from tensoropt.search.ft import SearchSpace, search
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

CPU_PROFILE = str(PROFILES_DIR / "cpu-2core.json")      # measured collectives, no overlap, no fusion
TINY_GPT = {"family": "gpt", "hidden_size": 64, "num_layers": 4, "num_attention_heads": 4,
            "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 256}


def _model(write_json, cfg, devices, per_node, profile="h100-80gb"):
    graph = tensoropt.capture(write_json("m.json", cfg)).graph
    return ModelCost(graph, tensoropt.fold(graph), Cluster(devices, per_node, load_profile(profile)))


def _front(result):
    return np.array([[p.iteration_time_s, p.peak_memory_bytes] for p in result.points])


@pytest.mark.parametrize("devices, per_node, profile, zero_stages", [
    (1, 1, "h100-80gb", (0, 1, 2, 3)), (4, 2, "h100-80gb", (0, 1, 2, 3)), (4, 4, "h100-80gb", (0, 1, 2, 3)),
    # gloo: all-gather and reduce-scatter at a third of all-reduce's rate, nothing overlapped, so ZeRO 2 can
    # be slower than ZeRO 0 and 1; a space without ZeRO 1
    (2, 2, CPU_PROFILE, (0, 1, 2, 3)), (4, 4, CPU_PROFILE, (0, 2, 3)), (2, 2, "h100-80gb", (3,))])
def test_ft_equals_exhaustive_enumeration(write_json, devices, per_node, profile, zero_stages):
    model = _model(write_json, TINY_GPT, devices, per_node, profile)
    space = SearchSpace(global_batch=8, micro_batches=(1, 2), max_virtual_stages=2, eps=0.0, zero_stages=zero_stages)
    ft, brute = search(model, devices, space), exhaustive_search(model, devices, space)
    assert brute.candidates > ft.candidates / 10                       # the brute force really enumerated
    np.testing.assert_allclose(_front(ft), _front(brute), rtol=1e-12)


@pytest.mark.parametrize("devices, profile", [(1, "h100-80gb"), (2, "h100-80gb"), (4, CPU_PROFILE)])
def test_ft_equals_exhaustive_enumeration_where_zero_1_widens_its_gradients(write_json, devices, profile):
    """The torch engine's bf16-mixed: FSDP2's ZeRO 1 sums bf16 gradients into float32 ones, more bytes a micro-batch
    than ZeRO 0's float32 sums below 4 micro-batches and fewer past them (``cost.accumulation``), and on one device
    ZeRO 3 holds no autocast copy of the weights, so no stage stands for another (``search.ft._undominated``);
    1 to 16 micro-batches a step."""
    model = _model(write_json, TINY_GPT, devices, devices, profile)
    space = SearchSpace(global_batch=16, micro_batches=(1, 2, 4), max_virtual_stages=2, eps=0.0,
                        precision="bf16-mixed", master_weights=False)
    ft, brute = search(model, devices, space), exhaustive_search(model, devices, space)
    assert brute.candidates > ft.candidates / 10
    np.testing.assert_allclose(_front(ft), _front(brute), rtol=1e-12)
    assert {p.plan.zero for p in brute.points} & {0, 1}


@pytest.mark.parametrize("profile", ["h100-80gb", CPU_PROFILE])
def test_folded_search_equals_unfolded_search(write_json, profile):
    cfg = {**TINY_GPT, "num_layers": 12}
    model = _model(write_json, cfg, 8, 4, profile)
    space = SearchSpace(global_batch=16, eps=0.0)
    folded, unfolded = search(model, 8, space), search(model, 8, space, doubling=False)
    np.testing.assert_allclose(_front(folded), _front(unfolded), rtol=1e-12)
    assert [p.plan for p in folded.points] == [p.plan for p in unfolded.points]


@pytest.mark.parametrize("profile, dtype", [("h100-80gb", "bfloat16"), (CPU_PROFILE, "float32")])
def test_frontier_points_are_sorted_non_dominated_and_priced_like_estimate(write_json, profile, dtype):
    model = _model(write_json, {**TINY_GPT, "num_layers": 8}, 8, 4, profile)
    result = search(model, 8, SearchSpace(global_batch=32, dtype=dtype))
    front = _front(result)
    assert len(front) > 3
    assert np.all(np.diff(front[:, 0]) > 0) and np.all(np.diff(front[:, 1]) < 0)   # faster costs memory
    for point in result.points:
        e = estimate(model, point.plan)
        assert e.iteration_time_s == pytest.approx(point.iteration_time_s, rel=1e-12)
        assert e.peak_memory_bytes == pytest.approx(point.peak_memory_bytes, rel=1e-12)
        assert sum(n for _, n in point.plan.blocks[0].strategies) * point.plan.pp == 8


def test_mixed_recomputation_fills_the_memory_gaps(write_json):
    """Per-layer choices give points between 'recompute nothing' and 'recompute everything'."""
    model = _model(write_json, {**TINY_GPT, "num_layers": 8}, 1, 1)
    result = search(model, 1, SearchSpace(global_batch=4, micro_batches=(4,), zero_stages=(0,), offload=False))
    mixes = [{s.recompute for s, _ in p.plan.blocks[0].strategies} for p in result.points]
    assert any(len(m) > 1 for m in mixes)


def test_epsilon_dominance_error_is_bounded(write_json):
    """With eps > 0 every point of the exact frontier is within (1 + eps)^d of a returned point in
    both objectives, d being the nesting depth of prunes (2 log2(copies) + 4), and returned points
    still price exactly."""
    model = _model(write_json, {**TINY_GPT, "num_layers": 16}, 8, 4)
    exact = _front(search(model, 8, SearchSpace(global_batch=32, eps=0.0)))
    for eps in (0.002, 0.02):
        result = search(model, 8, SearchSpace(global_batch=32, eps=eps))
        approx = _front(result)
        cover = max(min(max(a[0] / e[0], a[1] / e[1]) for a in approx) for e in exact)
        assert cover <= (1 + eps) ** (2 * np.log2(16) + 4)
        assert len(approx) <= len(exact)
        point = result.points[len(result.points) // 2]
        assert estimate(model, point.plan).iteration_time_s == pytest.approx(point.iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("devices, per_node, profile", [(1, 1, "h100-80gb"), (4, 2, "h100-80gb"),
                                                        (2, 2, CPU_PROFILE), (4, 4, CPU_PROFILE)])
def test_ft_equals_exhaustive_enumeration_with_bf16_gradients(write_json, devices, per_node, profile):
    """The torch engine's bf16-mixed space, float32 and bf16 gradients (ZeRO 1-3 only): FT, which drops the float32
    layout where the bf16 one is allowed before pricing (``ft._undominated``), finds the brute force's frontier,
    and every point is priced as ``estimate`` prices its plan."""
    model = _model(write_json, TINY_GPT, devices, per_node, profile)
    space = SearchSpace(global_batch=8, micro_batches=(1, 2), max_virtual_stages=2, eps=0.0, precision="bf16-mixed",
                        master_weights=False, engine="torch", offload=False, grad_dtypes=("", "bfloat16"))
    ft, brute = search(model, devices, space), exhaustive_search(model, devices, space)
    np.testing.assert_allclose(_front(ft), _front(brute), rtol=1e-12)
    assert any(p.plan.grad_dtype for p in ft.points)
    assert all(p.plan.zero >= 1 for p in ft.points if p.plan.grad_dtype)
    for point in ft.points:
        assert estimate(model, point.plan).peak_memory_bytes == pytest.approx(point.peak_memory_bytes, rel=1e-12)


def test_grouped_copies_equal_exhaustive_enumeration(write_json):
    """With at most 2 groups per stage, 8 copies run as 2 groups of 4: FT and brute force agree."""
    model = _model(write_json, {**TINY_GPT, "num_layers": 8}, 4, 2)
    space = SearchSpace(global_batch=8, micro_batches=(1, 2), max_virtual_stages=1, eps=0.0, max_layer_groups=2)
    ft, brute = search(model, 4, space), exhaustive_search(model, 4, space)
    np.testing.assert_allclose(_front(ft), _front(brute), rtol=1e-12)
    assert all(n % 2 == 0 or p.plan.pp == 8 for p in ft.points for _, n in p.plan.blocks[0].strategies)


@pytest.mark.parametrize("whole, split, changes", [
    (3, 1, 2),      # the SP copy in the device's second stage only: one slice and one gather
    (1, 3, 4),      # the SP copies span both stages (chain order: whole ones first): each slices and gathers
    (0, 4, 4), (4, 0, 0)])
def test_virtual_stages_each_pay_the_layout_changes_of_their_own_sequence_parallel_copies(write_json, whole, split,
                                                                                          changes):
    """pp2 x 2 virtual stages, 4 copies a device (2 a stage): each stage holding SP copies enters and leaves them
    with the whole sequence (runtime.pipeline.tp.shard_stage), so estimate prices ceil(n_sp / 2) pairs of
    layout changes; everything else is the layers' sums (hand-computed here) priced by evaluate."""
    model = _model(write_json, {**TINY_GPT, "num_layers": 8}, 8, 4)
    ((block, cost),) = model.blocks
    strategies = tuple((s, n) for s, n in ((LayerStrategy("none"), whole), (LayerStrategy("none", True), split)) if n)
    plan = Plan(devices=8, dp=2, tp=2, pp=2, micro_batch=1, global_batch=8, virtual_stages=2, zero=3,
                tp_branches=model.branch_names, blocks=(BlockPlan(block.name, strategies),))
    layers = [(cost.layer(s, 2, plan.tp_branches, 1), n) for s, n in strategies]
    time = sum(n * c.time_s for c, n in layers) + changes * cost.layout_change_s(2, 1)
    r = evaluate(model, Context.of(plan), [time], [sum(n * c.backward_s for c, n in layers)],
                 [sum(n * c.activation_bytes for c, n in layers)], [max(c.transient_bytes for c, _ in layers)],
                 [sum(n * c.parameters for c, n in layers)])
    assert cost.layout_change_s(2, 1) > 0
    assert estimate(model, plan).iteration_time_s == pytest.approx(float(r["iteration_time_s"][0]), rel=1e-12)


@pytest.mark.parametrize("spec, devices, batch, profile, engines", [
    ("gpt3-175b", 1024, 1536, "a100-80gb", ("torch", "deepspeed")),
    ("gpt3-175b", 1024, 1536, "h100-80gb", None),
    ("llama3-8b", 16, 64, "h100-80gb", ("torch", "deepspeed")),
    ("wide-resnet50-2", 16, 256, "a100-80gb", None),           # four blocks: bounded by the ideal point alone
    (TINY_GPT, 4, 16, CPU_PROFILE, ("torch", "deepspeed"))])
def test_bounding_contexts_keeps_the_frontier(write_json, monkeypatch, spec, devices, batch, profile, engines):
    """Contexts dropped by their bounds (search.bounds) cost nothing: the frontier (every point's time, memory and
    plan) is the one of the search that prices every context, and most contexts were dropped."""
    import functools

    import tensoropt.planning as planning
    graph = tensoropt.capture(spec if isinstance(spec, str) else write_json("m.json", spec),
                              precision="bf16-mixed").graph
    fronts, stats = [], []

    def searched(*args, bound, **kwargs):
        result = search(*args, bound=bound, **kwargs)
        stats.append(result.stats)
        return result
    for bound in (True, False):
        monkeypatch.setattr(planning, "search", functools.partial(searched, bound=bound))
        frontier = planning.plan(graph, Cluster(devices, 8 if devices >= 8 else devices, load_profile(profile)),
                                 global_batch=batch, engines=engines, fits=False)
        fronts.append([(p.iteration_time_s, p.peak_memory_bytes, p.plan) for p in frontier.points])
    assert fronts[0] == fronts[1]
    bounded = sum(s.get("bounded", 0) for s in stats)
    priced = sum(s["contexts"] for s in stats[:len(stats) // 2])
    assert bounded and priced < bounded          # fewer contexts priced in full than bounded
