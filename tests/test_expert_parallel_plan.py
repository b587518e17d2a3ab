"""Expert parallelism in the planner: the capture's experts of Hugging Face Mixture-of-Experts models, the price of an
ep plan checked against the graph's shapes (experts' weights over ep, states over dp, the all-to-alls), FT equal to
exhaustive enumeration with ep contexts, and the --ep flags of estimate and frontier with their one-line errors."""

import dataclasses
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from search_checks import ft_equals_exhaustive

import tensoropt
from tensoropt.cli import cli
from tensoropt.cost.comm import all_to_all_s
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.ops import OpArrays, op_times
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.search.engines import unsupported
from tensoropt.search.ft import SearchSpace, search
from tensoropt.space.experts import Experts, experts_report
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

# small Hugging Face configs, as examples/train_hf.py trains them (4 and 8 experts, top-2)
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "vocab_size": 128, "max_position_embeddings": 64, "router_jitter_noise": 0.0}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "vocab_size": 128, "max_position_embeddings": 64}


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def _graph(write_json, cfg):
    return tensoropt.capture(write_json("moe.json", cfg), seq_len=64).graph


def _model(graph, devices=4, per_node=4):
    return ModelCost(graph, tensoropt.fold(graph), Cluster(devices, per_node, load_profile("h100-80gb")))


@pytest.mark.parametrize("cfg, experts", [(MIXTRAL, 4), (QWEN3_MOE, 8)])
def test_the_capture_records_each_layers_experts_and_top_k(write_json, cfg, experts):
    graph = _graph(write_json, cfg)
    found = Experts.of(graph)
    assert [(path, e, k) for path, e, k in found.modules] == [
        (f"model.layers.{i}.mlp.experts", experts, 2) for i in range(2)]
    assert found.params == {f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                            for w in ("gate_up_proj", "down_proj")}
    sizes = dict(graph.params)
    expert_elements = sum(sizes[p].numel for p in found.params)
    report = experts_report(graph)
    # one token computes with every weight but the experts it does not visit: (1 - 2 / experts) of each layer's
    assert report["active_parameters"] == graph.num_parameters - round(expert_elements * (1 - 2 / experts))
    assert report["expert_parameters"] == expert_elements and report["top_k"] == [2]
    # the grouped products count every token-expert pair once: 2 x tokens x top-k x in x out, whatever the routing
    products = [op for op in graph.ops if op.target == "aten._grouped_mm.default"]
    assert len(products) == 4
    for op in products:
        rows, width = op.inputs[0].shape
        assert rows == 64 * 2 and op.forward_flops == 2 * rows * width * op.outputs[0].shape[1]


def _plan(ep: int, zero: int, recompute: str = "none") -> Plan:
    return Plan(devices=4, dp=4, tp=1, pp=1, micro_batch=2, global_batch=8, zero=zero, ep=ep, dtype="float32",
                master_weights=False, precision="32-true",
                blocks=(BlockPlan("model.layers.*", ((LayerStrategy(recompute), 2),)),))


@pytest.mark.parametrize("recompute, exchanges", [("none", 4), ("full", 6)])
def test_an_ep_copy_holds_its_share_of_the_experts_and_pays_the_all_to_alls(write_json, recompute, exchanges):
    model = _model(_graph(write_json, QWEN3_MOE))
    cost = model.blocks[0][1]
    plain = cost.layer(LayerStrategy(recompute), 1, (), 2)
    sharded = cost.layer(LayerStrategy(recompute), 1, (), 2, 1, 4)
    per_copy = cost.expert_params
    assert per_copy == sum(m.numel for n, m in model.graph.params if n.startswith("model.layers.0.mlp.experts."))
    assert sharded.parameters == pytest.approx(plain.parameters - per_copy * 3 / 4)
    # the dispatch moves the rows of the first grouped product: tokens x top-k x hidden x 2 bytes per sample (a
    # Hugging Face config is captured in bf16)
    assert cost.dispatch_bytes == 64 * 2 * 64 * 2
    assert sharded.ep_comm_s == pytest.approx(exchanges * all_to_all_s(cost.dispatch_bytes * 2, 4, 1, model.cluster))
    # the same token rows and FLOPs: the kept activations stay but for the two int64 row orders of the exchange (per
    # token-expert row: 64 tokens x top-2 a sample); the products read (and write gradients of) fewer weights, which
    # can only save time
    orders = 2 * 8 * 64 * 2 * 2
    if recompute == "full":
        assert (sharded.activation_bytes, sharded.transient_bytes) == \
            (plain.activation_bytes, plain.transient_bytes + 2 * cost.dispatch_bytes * 2 + orders)
    else:
        assert sharded.activation_bytes == plain.activation_bytes + orders
    assert sharded.forward_s <= plain.forward_s and sharded.backward_s <= plain.backward_s


def test_ep_saves_the_expert_weights_a_memory_bound_product_reads(write_json):
    """On a device whose products are memory-bound (a peak so high that FLOPs cost nothing), an ep copy's expert
    products save exactly the bytes of the weights the rank does not hold: read once in the forward, twice in the
    backward (read again and their gradients written)."""
    graph = _graph(write_json, QWEN3_MOE)
    h100 = load_profile("h100-80gb")
    fast = dataclasses.replace(h100, peak_flops=tuple((k, v * 1e9) for k, v in h100.peak_flops))
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(4, 4, fast))
    cost = model.blocks[0][1]
    plain, sharded = cost.layer(LayerStrategy(), 1, (), 2), cost.layer(LayerStrategy(), 1, (), 2, 1, 4)
    weights = sum(m.nbytes for n, m in graph.params if n.startswith("model.layers.0.mlp.experts."))
    saved_s = weights * 3 / 4 / fast.memory_bytes_per_s
    assert plain.forward_s - sharded.forward_s == pytest.approx(saved_s, rel=1e-9)
    assert plain.backward_s - sharded.backward_s == pytest.approx(2 * saved_s, rel=1e-9)


@pytest.mark.parametrize("precision, kernel", [("bf16-true", True), ("32-true", False)])
def test_a_grouped_product_runs_each_experts_product_at_its_own_size(write_json, precision, kernel):
    """A grouped expert product (``aten._grouped_mm``) of G experts is priced as G products of its FLOPs / G each on
    the profile's efficiency curve, not as one product of all its FLOPs; in bf16 torch's grouped kernel reaches the
    profile's ``grouped_matmul_efficiency`` of that (fitted in benchmarks/moe_kernels.py), in float32 torch runs one
    mm per group (its fallback) at the plain efficiency. At 64 tokens a micro-batch the products are compute-bound
    only on a device whose memory is free: priced with unlimited bandwidth, each is FLOPs / rate + the launch."""
    graph = tensoropt.capture(write_json("moe.json", QWEN3_MOE), seq_len=64, precision=precision).graph
    # the kernel's share set below 1 (the committed profiles' fit is 1.0), so that applying it shows
    free = dataclasses.replace(load_profile("h100-80gb"), memory_bandwidth_bytes_per_s=1e30,
                               grouped_matmul_efficiency=0.75)
    ops = tuple(op for op in graph.ops if op.target.startswith("aten._grouped_mm"))
    assert ops and all(op.inputs[1].shape[0] == 8 for op in ops)        # 8 experts: one group each
    forward, _ = op_times(OpArrays.of(ops, free), np.ones(len(ops)), 4, free)
    factor = free.grouped_matmul_efficiency if kernel else 1.0
    for op, seconds in zip(ops, forward):
        flops = op.forward_flops * 4
        rate = free.peak(op.outputs[0].dtype) * free.efficiency(flops / 8) * factor
        assert seconds == pytest.approx(flops / rate + free.kernel_overhead_s, rel=1e-12)
        assert seconds > flops / (free.peak(op.outputs[0].dtype) * free.efficiency(flops)) + free.kernel_overhead_s


def test_an_ep_rank_runs_its_experts_on_the_rows_of_its_ep_group(write_json):
    """Under ep 4 a rank holds 8 / 4 experts and each gets the rows of 4 ranks' tokens: its grouped products run 2
    products of 4x the rows (the same FLOPs), each at the efficiency of its larger size. With memory free (compute
    only), an ep copy's forward is the copy's without ep, less the grouped products' price at 8 groups, plus their
    price at 2."""
    graph = tensoropt.capture(write_json("moe.json", QWEN3_MOE), seq_len=64, precision="bf16-true").graph
    free = dataclasses.replace(load_profile("h100-80gb"), memory_bandwidth_bytes_per_s=1e30)
    cost = ModelCost(graph, tensoropt.fold(graph), Cluster(4, 4, free)).blocks[0][1]
    plain, sharded = cost.layer(LayerStrategy(), 1, (), 2), cost.layer(LayerStrategy(), 1, (), 2, 1, 4)
    ops = tuple(op for op in cost.ops if op.target.startswith("aten._grouped_mm"))
    arrays = OpArrays.of(ops, free)
    at_8 = op_times(arrays, np.ones(len(ops)), 2, free)[0].sum()
    at_2 = op_times(dataclasses.replace(arrays, groups=arrays.groups / 4), np.ones(len(ops)), 2, free)[0].sum()
    assert at_2 < at_8
    assert sharded.forward_s - plain.forward_s == pytest.approx(at_2 - at_8, rel=1e-9, abs=1e-15)


def test_zero_shards_the_experts_states_over_dp_as_without_ep(write_json):
    """ZeRO 0 holds a rank's experts / ep whole; ZeRO 3 holds experts / ep / (dp / ep) = the same share as at ep 1."""
    model = _model(_graph(write_json, QWEN3_MOE))
    held = model.expert_parameters * 3 / 4 * 4       # float32 weights: the experts ep 4 takes off a rank, bytes
    for zero, fewer in ((0, held), (3, 0.0)):
        one, four = estimate(model, _plan(1, zero)), estimate(model, _plan(4, zero))
        assert one.memory_breakdown["parameters_bytes"] - four.memory_breakdown["parameters_bytes"] == \
            pytest.approx(fewer)
        assert four.time_breakdown["expert_parallel_comm_s"] > 0


@pytest.mark.parametrize("per_node", [4, 2])
def test_ft_equals_exhaustive_enumeration_with_expert_parallelism(write_json, per_node):
    model = _model(_graph(write_json, MIXTRAL), 4, per_node)
    space = SearchSpace(global_batch=8, micro_batches=(1, 2), eps=0.0, expert_parallel=(1, 2, 4))
    ft = ft_equals_exhaustive(model, 4, space)
    assert any(p.plan.ep > 1 for p in ft.points)
    for point in ft.points:
        if point.plan.ep > 1:
            assert (point.plan.pp, point.plan.cp, point.plan.offload) == (1, 1, False)
            assert point.plan.dp % point.plan.ep == 0
            assert not unsupported(point.plan, "torch") and unsupported(point.plan, "deepspeed")


def test_a_dense_model_gets_no_ep_plan(write_json):
    dense = {**MIXTRAL, "model_type": "llama"}
    del dense["num_local_experts"], dense["num_experts_per_tok"], dense["router_jitter_noise"]
    model = _model(_graph(write_json, dense))
    assert not model.experts.modules and model.expert_parameters == 0
    assert all(p.plan.ep == 1 for p in search(model, 4, SearchSpace(global_batch=8)).points)


def test_estimate_and_frontier_ep_flags(write_json):
    moe = write_json("moe.json", MIXTRAL)
    common = ("--model", moe, "--gpus", 4, "--global-batch", 8, "--seq-len", 64, "--device", "h100-80gb")
    code, out = run("estimate", *common, "--tp", 1, "--pp", 1, "--micro-batch", 2, "--ep", 2, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["plan"]["ep"] == 2 and report["engine"] == "torch" and "dp4 ep2 tp1" in report["plan"]["summary"]
    assert report["time_breakdown"]["expert_parallel_comm_s"] > 0
    code, out = run("estimate", *common, "--tp", 1, "--pp", 1, "--ep", 3)
    assert code != 0 and "4 experts do not divide by 3" in out and out.count("\n") == 1
    code, out = run("estimate", *common, "--tp", 1, "--pp", 1, "--ep", 2, "--engine", "deepspeed")
    assert code != 0 and "expert parallelism" in out and out.count("\n") == 1
    code, out = run("frontier", *common, "--ep", 2, "--json")
    assert code == 0, out
    points = json.loads(out)["points"]
    assert points and all(p["plan"]["ep"] == 2 for p in points)
    code, out = run("frontier", *common, "--ep", 8)
    assert code != 0 and out.startswith("error: --ep 8:") and out.count("\n") == 1
    dense = write_json("dense.json", {"family": "llama", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
                                       "ffn_hidden_size": 128, "seq_length": 64, "vocab_size": 128})
    code, out = run("frontier", "--model", dense, "--gpus", 4, "--global-batch", 8, "--ep", 2)
    assert code != 0 and "has none" in out and out.count("\n") == 1


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"])
def test_moe_presets_match_their_published_totals_and_active_parameters(name):
    """The presets are the published configs: built on meta, their parameters and the ones a token computes with (every
    weight but the experts it does not visit) are the publishers' (two significant figures: 2%)."""
    from tensoropt.graph.experts import experts_modules
    from tensoropt.models.hf_presets import HF_PRESETS
    from tensoropt.models.sources import resolve_model
    preset = HF_PRESETS[name]
    model, _ = resolve_model(name).build(1, 64)
    total = sum(p.numel() for p in model.parameters())
    sizes = dict(model.named_parameters())
    idle = sum(sizes[p].numel() * (1 - m["top_k"] / m["experts"]) for m in experts_modules(model).values()
               for p in m["params"])
    assert total == pytest.approx(preset.published_parameters, rel=0.02)
    assert total - idle == pytest.approx(preset.active_parameters, rel=0.02)


def test_a_routing_imbalance_prices_the_busiest_rank(write_json):
    """With --routing-imbalance f the busiest ep rank receives, computes and keeps f x the average rows: its
    all-to-alls move f x the bytes and it keeps (f - 1) x the expert products' saved tensors and the dispatched rows
    more; at ep 1 nothing changes (each rank computes its own tokens' experts)."""
    from tensoropt.space.experts import with_routing_imbalance
    graph = _graph(write_json, QWEN3_MOE)
    even, skewed = _model(graph), _model(with_routing_imbalance(graph, 1.5))
    a, b = even.blocks[0][1], skewed.blocks[0][1]
    assert b.layer(LayerStrategy(), 1, (), 2) == a.layer(LayerStrategy(), 1, (), 2)
    one, more = a.layer(LayerStrategy(), 1, (), 2, 1, 4), b.layer(LayerStrategy(), 1, (), 2, 1, 4)
    assert more.ep_comm_s == pytest.approx(4 * all_to_all_s(a.dispatch_bytes * 2 * 1.5, 4, 1, even.cluster))
    expert_saved = sum(op.saved_bytes for op in even.blocks[0][0].ops
                       if any(r.name in even.experts.params for r in op.sources))
    orders = 2 * 8 * 64 * 2 * 2                      # the exchange's two int64 row orders, f x the rows too
    assert more.activation_bytes - one.activation_bytes == \
        pytest.approx(0.5 * 2 * (expert_saved + a.dispatch_bytes) + 0.5 * orders)
    assert more.forward_s > one.forward_s and more.backward_s > one.backward_s
    code, out = run("estimate", "--model", write_json("moe.json", MIXTRAL), "--gpus", 4, "--tp", 1, "--pp", 1,
                    "--global-batch", 8, "--routing-imbalance", 0.5)
    assert code != 0 and "--routing-imbalance" in out and out.count("\n") == 1


def test_dense_layers_of_an_moe_model_run_as_without_ep(write_json):
    """A model whose first layers are dense (DeepSeek-V3's first three, Qwen3-MoE's ``mlp_only_layers``) folds into a
    dense block and an MoE block: at ep 2 the dense one is priced as without ep, the MoE one shards its experts."""
    model = _model(_graph(write_json, {**QWEN3_MOE, "num_hidden_layers": 4, "mlp_only_layers": [0, 1]}))
    assert len(model.blocks) == 2
    dense, moe = sorted((cost for _, cost in model.blocks), key=lambda c: c.expert_params)
    assert dense.expert_params == 0 and moe.expert_params > 0
    assert dense.layer(LayerStrategy(), 1, (), 2, 1, 2) == dense.layer(LayerStrategy(), 1, (), 2)
    assert moe.layer(LayerStrategy(), 1, (), 2, 1, 2).ep_comm_s > 0
    plan = Plan(devices=4, dp=4, tp=1, pp=1, micro_batch=2, global_batch=8, ep=2,
                blocks=tuple(BlockPlan(b.name, ((LayerStrategy(), b.repeats),)) for b, _ in model.blocks))
    assert estimate(model, plan).time_breakdown["expert_parallel_comm_s"] > 0


# two dense layers, then three MoE ones: two blocks of one pattern, with different numbers of copies
DENSE_FIRST = {**QWEN3_MOE, "num_hidden_layers": 5, "mlp_only_layers": [0, 1]}


def _by_block(model, dense: str, moe: str) -> Plan:
    """dp4 ep2 mb2x1, the dense block's copies under ``dense`` recomputation, the MoE block's under ``moe``."""
    (d, _), (m, _) = model.blocks
    return Plan(devices=4, dp=4, tp=1, pp=1, micro_batch=2, global_batch=8, ep=2,
                blocks=(BlockPlan(d.name, ((LayerStrategy(dense), d.repeats),)),
                        BlockPlan(m.name, ((LayerStrategy(moe), m.repeats),))))


def test_a_dense_and_an_moe_block_of_one_pattern_are_named_by_their_copies(write_json):
    """The two blocks' copies are all ``model.layers.*``: each is named by the slice of them it holds (a plan naming
    both ``model.layers.*`` gave the two one plan's strategies), and the runtime finds those copies by that name."""
    from tensoropt.models.sources import resolve_model
    from tensoropt.runtime.blocks import block_modules, copies_of
    from tensoropt.runtime.memory.recompute import recomputed_modules
    path = write_json("moe.json", DENSE_FIRST)
    model = _model(_graph(write_json, DENSE_FIRST))
    assert [(b.name, b.repeats) for b, _ in model.blocks] == [("model.layers.*[0:2]", 2), ("model.layers.*[2:5]", 3)]
    module, _ = resolve_model(path).build(1, 64)
    assert [copies_of(module, b.name) for b, _ in model.blocks] == [
        ["model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3", "model.layers.4"]]
    plan = _by_block(model, "full", "none")
    assert recomputed_modules(module, plan) == ["model.layers.0", "model.layers.1"]
    assert block_modules(module, plan) == [f"model.layers.{i}" for i in range(5)]      # FSDP2's units, each once


def test_each_block_is_priced_with_its_own_strategies(write_json):
    """estimate of a plan recomputing the dense block only: the recomputation is the dense copies', the experts'
    all-to-alls the MoE copies' (one micro-batch); and every point FT finds is priced by estimate as FT prices it,
    points whose two blocks run different strategies among them."""
    model = _model(_graph(write_json, DENSE_FIRST))
    (_, dense), (_, moe) = model.blocks
    full, none = dense.layer(LayerStrategy("full"), 1, (), 2, 1, 2), moe.layer(LayerStrategy("none"), 1, (), 2, 1, 2)
    got = estimate(model, _by_block(model, "full", "none")).time_breakdown
    assert full.recompute_s > 0 and none.recompute_s == 0
    assert got["recompute_s"] == pytest.approx(2 * full.recompute_s, rel=1e-12)
    assert got["forward_backward_s"] == pytest.approx(
        2 * (full.forward_s + full.backward_s) + 3 * (none.forward_s + none.backward_s), rel=1e-12)
    assert got["expert_parallel_comm_s"] == pytest.approx(3 * none.ep_comm_s, rel=1e-12)
    ft = ft_equals_exhaustive(model, 4, SearchSpace(global_batch=8, micro_batches=(2,), eps=0.0,
                                                    expert_parallel=(2,)))
    assert any(p.plan.blocks[0].strategies != p.plan.blocks[1].strategies for p in ft.points)


def test_estimate_prices_a_frontier_plan_of_two_blocks_as_the_frontier_does(write_json):
    """``tensoropt estimate`` with a frontier point's flags (the same strategy in both blocks) gives its figures: it
    had priced the dense block with the MoE block's three copies."""
    common = ("--model", write_json("moe.json", DENSE_FIRST), "--gpus", 4, "--global-batch", 8, "--seq-len", 64,
              "--device", "h100-80gb", "--ep", 2)
    code, out = run("frontier", *common, "--json")
    assert code == 0, out
    points = [p for p in json.loads(out)["points"] if p["plan"]["summary"].endswith("zero2 [2xfull] [3xfull]")]
    assert len(points) == 1 and points[0]["plan"]["micro_batch"] == 2
    code, out = run("estimate", *common, "--tp", 1, "--pp", 1, "--micro-batch", 2, "--zero", 2, "--recompute", "full",
                    "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["plan"]["blocks"] == points[0]["plan"]["blocks"]
    assert report["iteration_time_s"] == pytest.approx(points[0]["iteration_time_s"], rel=1e-12)
    assert report["peak_memory_bytes"] == pytest.approx(points[0]["peak_memory_bytes"], rel=1e-9)


def test_a_plan_naming_a_block_twice_is_refused(write_json):
    """A plan written before blocks sharing a pattern were told apart names both ``model.layers.*``: refused, not
    priced or run as one block."""
    model = _model(_graph(write_json, DENSE_FIRST))
    plan = _by_block(model, "full", "none")
    twice = dataclasses.replace(plan, blocks=tuple(BlockPlan("model.layers.*", bp.strategies) for bp in plan.blocks))
    with pytest.raises(ValueError, match=r"block model\.layers\.\* is named 2 times"):
        estimate(model, twice)
    with pytest.raises(ValueError, match=r"block model\.layers\.\* is named 2 times"):
        Plan.from_json(twice.to_json())


def test_a_plan_naming_a_block_the_model_lacks_is_refused(write_json):
    """A plan of the MoE block alone, under its old name: its strategies would be lost and both blocks priced with
    none (a stale plan.json); refused, naming the model's blocks."""
    model = _model(_graph(write_json, DENSE_FIRST))
    plan = _by_block(model, "full", "none")
    stale = dataclasses.replace(plan, blocks=(BlockPlan("model.layers.*", plan.blocks[1].strategies),))
    names = ", ".join(block.name for block, _ in model.blocks)
    with pytest.raises(ValueError, match=rf"names block 'model\.layers\.\*', which this model does not have \(its "
                                         rf"blocks: {re.escape(names)}\)"):
        estimate(model, stale)


def test_a_top_k_above_the_experts_is_one_line(write_json):
    code, out = run("inspect", "--model", write_json("bad.json", {**MIXTRAL, "num_experts_per_tok": 6}), "--no-cache")
    assert code != 0 and out.count("\n") == 1
    assert "model.layers.0.mlp.experts routes each token to 6 experts and has 4: give num_experts_per_tok" in out
