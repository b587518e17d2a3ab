"""Context parallelism in the planner: its price (cost.context_parallel) checked against the graph's shapes, FT equal
to exhaustive enumeration with cp meshes, the --cp flags of estimate and frontier, and the models that refuse it."""

import dataclasses
import json

import pytest
from click.testing import CliRunner
from search_checks import ft_equals_exhaustive

import tensoropt
from tensoropt.cli import cli
from tensoropt.cost.comm import all_gather_s, reduce_scatter_s
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import PROFILES_DIR, Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.planning import plan
from tensoropt.search.engines import unsupported
from tensoropt.search.ft import SearchSpace, search
from tensoropt.search.limits import Limits
from tensoropt.space.context_parallel import CONTEXT_PARALLEL_META, default_degrees, graph_refusal
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

CPU_PROFILE = str(PROFILES_DIR / "cpu-2core.json")
HEADS, KV_HEADS, HIDDEN, SEQ = 4, 2, 64, 512
# a long sequence for a small model: the S x S attention scores dominate, so context parallelism pays
LONG = {"family": "llama", "hidden_size": HIDDEN, "num_layers": 4, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "ffn_hidden_size": 128, "seq_length": SEQ, "vocab_size": 128,
        "attention": "eager"}
BF16 = 2


def _graph(write_json, cfg=LONG):
    return tensoropt.capture(write_json("m.json", cfg)).graph


def _model(graph, devices=4, per_node=4, profile="h100-80gb"):
    return ModelCost(graph, tensoropt.fold(graph), Cluster(devices, per_node, load_profile(profile)))


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def test_the_capture_key_is_the_planners():
    from tensoropt.graph.capture import CONTEXT_PARALLEL_META as captured
    assert captured == CONTEXT_PARALLEL_META


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_copy_at_cp2_is_the_copy_at_half_the_samples_plus_the_gathered_keys_and_values(write_json, recompute):
    model = _model(_graph(write_json))
    cost = model.blocks[0][1]
    strategy, head_dim = LayerStrategy(recompute), HIDDEN // HEADS
    # from the shapes: the runtime all-gathers K and V of the kv heads (before any GQA repeat) over the whole sequence
    # and keeps the rank's share of them (S / cp long) for the backward, which gathers them again; the captured eager
    # attention saved the repeated copies (all heads), which the grouped attention under CP never makes
    gathered = 2 * SEQ * KV_HEADS * head_dim * BF16
    repeated = 2 * SEQ * HEADS * head_dim * BF16
    for mb in (2, 4):
        one, two = cost.layer(strategy, 1, (), mb // 2), cost.layer(strategy, 1, (), mb, 2)
        assert two.forward_s == one.forward_s and two.backward_s == one.backward_s      # compute divides by cp
        assert two.recompute_s == one.recompute_s and two.parameters == one.parameters
        extra = (gathered - repeated) * mb / 2                       # the share kept instead of the repeated copies
        regathered = (2 * (1 - 1 / 2) + 0.5) * gathered * mb         # held while the backward runs
        if recompute == "full":       # keeps the input checkpoint of its share; its backward holds the rest
            assert two.activation_bytes == one.activation_bytes
            assert two.transient_bytes == pytest.approx(one.transient_bytes + extra + regathered, rel=1e-12)
        else:
            assert two.activation_bytes == pytest.approx(one.activation_bytes + extra, rel=1e-12)
            assert two.transient_bytes == pytest.approx(one.transient_bytes + regathered, rel=1e-12)
        gather = all_gather_s(gathered * mb, 2, 1, model.cluster)
        # the forward's gathers, the backward's again and its reduce-scatters; a full recomputation's forward gathers
        comm = 2 * gather + reduce_scatter_s(gathered * mb, 2, 1, model.cluster) + (recompute == "full") * gather
        assert gather > 0 and two.cp_comm_s == pytest.approx(comm, rel=1e-12)
        assert two.time_s == pytest.approx(one.time_s + comm, rel=1e-12)


@pytest.mark.parametrize("branches", [("attn", "mlp"), ("mlp",)])
def test_under_tp_a_cp_copy_gathers_its_share_of_the_heads_and_its_tokens_tp_traffic(write_json, branches):
    model = _model(_graph(write_json))
    cost, strategy, head_dim = model.blocks[0][1], LayerStrategy("none", True), HIDDEN // HEADS
    # a rank of a tp-sharded attention holds kv heads / tp of the keys and values it gathers over the cp ranks
    # (stride tp in the dp x cp x tp mesh); a replicated one all of them
    heads = KV_HEADS // 2 if "attn" in branches else KV_HEADS
    saved_heads = HEADS // 2 if "attn" in branches else HEADS
    mb = 2
    one, two = cost.layer(strategy, 2, branches, mb // 2), cost.layer(strategy, 2, branches, mb, 2)
    gathered = 2 * SEQ * heads * head_dim * BF16 * mb
    comm = 2 * all_gather_s(gathered, 2, 2, model.cluster) + reduce_scatter_s(gathered, 2, 2, model.cluster)
    assert two.cp_comm_s == pytest.approx(comm, rel=1e-12)
    # tensor-parallel (and sequence-parallel) traffic is of the rank's S / cp tokens: as at half the samples; its
    # reduce-scatters' copies are of as many bytes, but two samples' chunks are concatenated where one sample's run
    # on a view (``BlockCost.sp_copies_s``)
    copies = {k: sum(cost.sp_copies_s(2, branches, *k)) for k in ((mb // 2, 1), (mb, 2))}
    assert copies[mb, 2] > copies[mb // 2, 1] == 0
    assert two.tp_comm_s - copies[mb, 2] == pytest.approx(one.tp_comm_s - copies[mb // 2, 1], rel=1e-12)
    assert two.tp_comm_s > 0
    extra = (gathered - 2 * SEQ * saved_heads * head_dim * BF16 * mb) / 2
    assert two.activation_bytes == pytest.approx(one.activation_bytes + extra, rel=1e-12)
    assert two.transient_bytes == pytest.approx(one.transient_bytes + 1.5 * gathered, rel=1e-12)


def test_a_cp2_plan_shares_its_states_over_dp_x_cp(write_json):
    model = _model(_graph(write_json))
    blocks = (BlockPlan(model.blocks[0][0].name, ((LayerStrategy("none"), 4),)),)
    context = estimate(model, Plan(4, 2, 1, 1, 2, 8, zero=1, blocks=blocks, cp=2))
    flat = estimate(model, Plan(4, 4, 1, 1, 1, 8, zero=1, blocks=blocks))
    # ZeRO 1 over the dp x cp ranks: the optimizer states divide by 4 in both
    assert context.memory_breakdown["optimizer_bytes"] == flat.memory_breakdown["optimizer_bytes"]
    assert context.time_breakdown["context_parallel_comm_s"] > 0
    assert "context_parallel_comm_s" not in flat.time_breakdown
    # the same tokens per rank and step (2 micro-batches of half of 2 samples against 2 of one sample): the same layer
    # compute, beside the gathers
    assert context.time_breakdown["forward_backward_s"] == pytest.approx(flat.time_breakdown["forward_backward_s"],
                                                                         rel=1e-12)


@pytest.mark.parametrize("devices, per_node, profile", [(4, 4, "h100-80gb"), (4, 2, "h100-80gb"),
                                                        (4, 4, CPU_PROFILE)])
def test_ft_equals_exhaustive_enumeration_with_context_parallelism(write_json, devices, per_node, profile):
    model = _model(_graph(write_json), devices, per_node, profile)
    space = SearchSpace(global_batch=8, micro_batches=(1, 2), max_virtual_stages=2, eps=0.0,
                        context_parallel=(1, 2, 4))
    ft = ft_equals_exhaustive(model, devices, space)
    assert any(p.plan.cp > 1 for p in ft.points)
    for point in ft.points:
        if point.plan.cp > 1:
            assert (point.plan.pp, point.plan.offload) == (1, False)
            assert not unsupported(point.plan, "torch") and unsupported(point.plan, "deepspeed")


def test_the_default_degrees_leave_4096_tokens_per_rank(write_json):
    assert default_degrees(8, 2048) == () and default_degrees(8, 8192) == (2,)
    assert default_degrees(8, 131072) == (2, 4, 8)
    model = _model(_graph(write_json))          # 512 tokens: no cp by default, any valid one when named
    assert all(p.plan.cp == 1 for p in search(model, 4, SearchSpace(global_batch=8)).points)
    only = search(model, 4, SearchSpace(global_batch=8, context_parallel=(2,))).points
    assert only and all(p.plan.cp == 2 for p in only)


def test_a_model_that_refuses_gets_no_cp_plan_and_a_one_line_reason(write_json):
    graph = _graph(write_json)
    refused = dataclasses.replace(graph, metadata=tuple(
        (k, "its forward computes positions from its input") if k == CONTEXT_PARALLEL_META else (k, v)
        for k, v in graph.metadata))
    assert graph_refusal(graph, 2) == ""
    assert "positions from its input" in graph_refusal(refused, 2)
    assert "does not divide the sequence length 512" in graph_refusal(graph, 3)
    model = _model(refused)
    assert all(p.plan.cp == 1 for p in search(model, 4, SearchSpace(global_batch=8, context_parallel=(1, 2))).points)
    cluster = Cluster(4, 4, load_profile("h100-80gb"))
    with pytest.raises(TensorOptError, match=r"^--cp 2: the model cannot run context-parallel: its forward") as err:
        plan(refused, cluster, global_batch=8, limits=Limits(context_parallel=(2,)))
    assert "\n" not in str(err.value)
    with pytest.raises(TensorOptError, match="torch engine only: drop --engine deepspeed"):
        plan(graph, cluster, global_batch=8, limits=Limits(context_parallel=(2,)), engines=("deepspeed",))
    found = plan(graph, cluster, global_batch=8, limits=Limits(context_parallel=(2,)), fits=False)
    assert found.points and all(p.plan.cp == 2 for p in found.points)


def test_engines_name_what_cp_does_not_run_with():
    base = Plan(8, 2, 1, 1, 1, 8, cp=4)
    assert unsupported(base, "torch") == []
    assert unsupported(base, "deepspeed") == ["context parallelism (the torch engine runs it)"]
    # with tensor parallelism: FSDP2 over the flattened dp x cp ranks (DDP takes no tensor-parallel DTensors)
    assert unsupported(dataclasses.replace(base, dp=1, tp=2, zero=1), "torch") == []
    assert unsupported(dataclasses.replace(base, dp=1, tp=2), "torch") == [
        "tensor and data parallelism without ZeRO 1, 2 or 3"]
    assert "context parallelism with pipeline stages" in unsupported(dataclasses.replace(base, dp=1, pp=2), "torch")
    assert unsupported(dataclasses.replace(base, compile=True), "torch") == ["compiled blocks with context parallelism"]
    assert "optimizer offload" in unsupported(dataclasses.replace(base, zero=1, offload=True), "torch")


def test_limits_name_cp():
    limits = Limits(context_parallel=(1, 2))
    assert limits.flags() == "--cp 1,2" and limits.describe() == "limited to cp 1,2"
    assert limits.restrict(SearchSpace(global_batch=8)).context_parallel == (1, 2)


def test_estimate_cp_flag(write_json):
    model = write_json("m.json", LONG)
    common = ("estimate", "--model", model, "--gpus", 4, "--tp", 1, "--pp", 1, "--global-batch", 8,
              "--micro-batch", 2, "--device", "h100-80gb")
    code, out = run(*common, "--cp", 2, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["plan"]["cp"] == 2 and report["plan"]["dp"] == 2 and report["engine"] == "torch"
    assert report["time_breakdown"]["context_parallel_comm_s"] > 0
    assert "dp2 cp2 tp1" in report["plan"]["summary"]
    code, out = run(*common, "--cp", 3)
    assert code != 0 and "--cp 3 x --tp 1 x --pp 1 must divide --gpus 4" in out and out.count("\n") == 1
    code, out = run(*common, "--cp", 2, "--engine", "deepspeed")
    assert code != 0 and "context parallelism" in out and "--engine deepspeed" in out and out.count("\n") == 1
    code, out = run(*common[:-2], "--device", "h100-80gb", "--cp", 4, "--seq-len", 36)
    assert code != 0 and "8 does not divide the sequence length 36" in out and out.count("\n") == 1
    moe = write_json("moe.json", {**LONG, "family": "moe", "attention": "flash", "num_experts": 4})
    code, out = run("estimate", "--model", moe, *common[3:], "--cp", 2)
    assert code != 0 and "token-routed (MoE)" in out and out.count("\n") == 1
    code, out = run("frontier", "--model", moe, "--gpus", 4, "--global-batch", 8, "--cp", 2)
    assert code != 0 and out.startswith("error: --cp 2: the model cannot run context-parallel") \
        and out.count("\n") == 1


def test_frontier_of_llama3_8b_at_128k_tokens_holds_cp_plans():
    code, out = run("frontier", "--model", "llama3-8b", "--gpus", 8, "--device", "h100-80gb", "--seq-len", 131072,
                    "--global-batch", 8, "--json")
    assert code == 0, out
    points = json.loads(out)["points"]
    assert any(p["plan"].get("cp", 1) > 1 for p in points)
    for p in points:
        if p["plan"].get("cp", 1) > 1:
            assert p["plan"]["pp"] == 1 and p["plan"]["dp"] * p["plan"]["cp"] * p["plan"]["tp"] == 8
