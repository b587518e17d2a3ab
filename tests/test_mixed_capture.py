"""bf16-mixed is captured twice, once per way the engines run it (issue 19 part 5): DDP computes with float32 weights
that autocast casts per op (a float32 residual stream), FSDP2 (ZeRO 1-3) and DeepSpeed with bf16 weights (a bf16
stream, no per-op weight copies). Each plan is priced with the graph its engine runs; the launcher's frontier and
its ``price`` of any point agree."""

import pytest
from conftest import EXAMPLES

from launcher.capture import capture_script
from launcher.launch import Devices, cluster, cost_model, planned_precision, price, runnable_front
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import load_profile
from tensoropt.graph.bf16_meta import bf16_weights_graph
from tensoropt.planning import folded
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

SCRIPT = str(EXAMPLES / "train_llama_large.py")
TINY = ["--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "128",
        "--seq-len", "32", "--global-batch", "8"]
DEVICES = Devices("cuda", 4, 80 * 2**30, load_profile("h100-80gb"))


@pytest.fixture(scope="module")
def mixed():
    return capture_script(SCRIPT, TINY, use_cache=False, precision="bf16-mixed")


def _stream_dtype(graph) -> str:
    """The dtype of the embedding's output: the residual stream's at its start."""
    return next(op.outputs[0].dtype for op in graph.ops if op.target == "aten.embedding.default")


def test_bf16_mixed_is_captured_with_float32_and_with_bf16_weights(mixed):
    bf16 = bf16_weights_graph(mixed)
    assert bf16 is not None
    assert (_stream_dtype(mixed), _stream_dtype(bf16)) == ("float32", "bfloat16")
    assert [n for n, _ in bf16.params] == [n for n, _ in mixed.params]
    # the rotary tables cast to the bf16 stream (``.to(x.dtype)``) are tensors each forward makes: recorded
    casts = [op for op in bf16.ops if op.target == "aten._to_copy.default" and op.sources[0].kind == "buffer"]
    assert casts and all(op.outputs[0].dtype == "bfloat16" for op in casts)
    for precision in ("bf16-true", "32-true"):
        assert bf16_weights_graph(capture_script(SCRIPT, TINY, use_cache=False, precision=precision)) is None


def test_a_script_under_its_own_bf16_autocast_is_captured_with_bf16_weights_too():
    """nanoGPT's ``with ctx:`` around the step: captured in its own autocast (float32 weights), and again with the
    weights FSDP2 and DeepSpeed would compute with."""
    graph = capture_script(str(EXAMPLES / "train_nanogpt.py"), [], use_cache=False)
    bf16 = bf16_weights_graph(graph)
    assert graph.meta("autocast") == "bfloat16" and bf16 is not None
    assert (_stream_dtype(graph), _stream_dtype(bf16)) == ("float32", "bfloat16")


def _plan(zero: int, pp: int = 1) -> Plan:
    return Plan(devices=4, dp=4 // pp, tp=1, pp=pp, micro_batch=1, global_batch=8, zero=zero,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 4 // pp),)),))


@pytest.mark.parametrize("engine, zero, pp, with_bf16_weights", [
    ("torch", 0, 1, False),         # DDP: float32 weights under autocast
    ("torch", 3, 1, True),          # FSDP2 gathers bf16 weights
    ("torch", 1, 2, True),          # pipeline stages under FSDP2 are traced with its bf16 weights
    ("torch", 0, 2, False),         # under DDP with the float32 ones
    ("deepspeed", 1, 1, True),      # DeepSpeed's bf16 module
])
def test_each_plan_is_priced_with_the_graph_its_engine_runs(mixed, engine, zero, pp, with_bf16_weights):
    plan = planned_precision(_plan(zero, pp), engine, "bf16-mixed")
    expected = bf16_weights_graph(mixed) if with_bf16_weights else mixed
    other = mixed if with_bf16_weights else bf16_weights_graph(mixed)
    point = price(mixed, DEVICES, 4, plan, engine, "bf16-mixed")
    by_graph = {id(g): estimate(ModelCost(g, folded(g), cluster(DEVICES, 4)), plan) for g in (expected, other)}
    assert (point.iteration_time_s, point.peak_memory_bytes) == (by_graph[id(expected)].iteration_time_s,
                                                                 by_graph[id(expected)].peak_memory_bytes)
    assert point.peak_memory_bytes != by_graph[id(other)].peak_memory_bytes       # the two graphs price apart
    assert cost_model(mixed, DEVICES, 4, plan).graph is expected


def test_the_frontier_prices_each_point_as_price_does(mixed):
    """The search splits the space by graph (ZeRO 0 on the float32 weights, ZeRO 1-3 on the bf16 ones): every point
    it returns is priced as ``price`` prices that plan alone, on both engines."""
    front = runnable_front(mixed, DEVICES, 4, precision="bf16-mixed")
    assert {engine for _, engine in front} == {"torch", "deepspeed"}
    assert any(p.plan.zero >= 1 and p.plan.pp == 1 for p, _ in front)
    for point, engine in front:
        again = price(mixed, DEVICES, 4, point.plan, engine, "bf16-mixed")
        assert again.peak_memory_bytes == pytest.approx(point.peak_memory_bytes, rel=1e-9), point.plan.summary()
        assert again.iteration_time_s == pytest.approx(point.iteration_time_s, rel=1e-9), point.plan.summary()
