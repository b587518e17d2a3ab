"""plan.json as the workers read it: ``RunPlan`` round-trips the file the launcher writes, key for key and byte
for byte, and a bad field is a one-line error naming it (before any worker joins a process group)."""

import json

import pytest
import torch
from conftest import REPO, SMALL_GPT

import tensoropt
from launcher.launch import Devices, price, write_plan
from tensoropt.cost.profile import load_profile
from tensoropt.errors import TensorOptError
from tensoropt.graph.fold import fold
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan
from tensoropt.space.run_plan import RunPlan
from tensoropt.space.tp_layout import tp_layout

DEVICES = Devices("cuda", 2, 80 * 2**30, load_profile("h100-80gb"))


def _fused_gpt():
    """tests/train_fused.py's GPT with a fused QKV and gate-up projection: its layout has ``segments``."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_fused", REPO / "tests" / "train_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ids = torch.zeros(2, 16, dtype=torch.long)
    return tensoropt.capture(module.GPT(96, 16, 32, 4, 2, "chunk", "gate-up"), (ids, ids), cache=False).graph


def _written(graph, tmp_path, tp: int, engine: str = "torch") -> dict:
    """The plan.json ``tensoropt launch`` writes for a tp-way plan of ``graph`` (sequence-parallel, selective)."""
    (block,) = fold(graph).blocks
    branches = tuple(b["branch"] for b in tp_layout(graph).get(block.name, [])) if tp > 1 else ()
    plan = Plan(devices=2, dp=2 // tp, tp=tp, pp=1, micro_batch=1, global_batch=4, zero=1 if engine == "torch" else 2,
                tp_branches=branches,
                blocks=(BlockPlan(block.name, ((LayerStrategy("selective", tp > 1), block.repeats),)),))
    point = price(graph, DEVICES, 2, plan, engine, "bf16-mixed")
    path = write_plan(tmp_path, point, engine, "chosen by the test", ["torchrun", "train.py"], graph, "cpu")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def gpt_graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt") / "gpt.json"
    path.write_text(json.dumps(SMALL_GPT))
    return tensoropt.capture(str(path), batch_size=1, seq_len=32).graph


def test_run_plan_round_trips_the_plan_json_the_launcher_writes(gpt_graph, tmp_path):
    written = _written(gpt_graph, tmp_path, tp=2)
    assert written["vocab_parallel"]["enabled"] and written["tp_layout"]          # both extras are there
    run_plan = RunPlan.from_json(written)
    assert run_plan.to_json() == written and list(run_plan.to_json()) == list(written)     # keys and their order
    assert json.dumps(run_plan.to_json(), separators=(",", ":")) == (tmp_path / "plan.json").read_text()
    assert run_plan == RunPlan.read(tmp_path / "plan.json")
    # typed: attributes, immutable tuples, the launcher's extras
    assert (run_plan.engine, run_plan.device, run_plan.plan.tp, run_plan.plan.zero) == ("torch", "cpu", 2, 1)
    (bp,) = run_plan.plan.blocks
    assert bp.strategies == ((LayerStrategy("selective", True), 4),)
    assert [b.branch for b in run_plan.layout_of("layers.*")] == ["attn", "mlp"]
    assert run_plan.vocab_parallel.vocab == 128 and run_plan.command == ("torchrun", "train.py")
    assert run_plan.predicted.why == "chosen by the test" and run_plan.deepspeed_config is None
    # the GPT's loss is one F.cross_entropy on rows of logits: it runs on the runtime's lean loss, as it was priced
    assert written["lean_loss"] is True and run_plan.lean_loss


def test_fused_segments_and_a_deepspeed_config_round_trip(gpt_graph, tmp_path):
    fused = _written(_fused_gpt(), tmp_path / "fused", tp=2)
    segmented = {b["branch"]: b["segments"] for b in fused["tp_layout"]["h.*"]}
    assert segmented == {"attn": {"attn.c_attn": [32, 32, 32]}, "mlp": {"mlp.gate_up_proj": [128, 128]}}
    run_plan = RunPlan.from_json(fused)
    assert run_plan.to_json() == fused and run_plan.layout_of("h.*")[0].segments_of("attn.c_attn") == (32, 32, 32)
    deepspeed = _written(gpt_graph, tmp_path / "ds", tp=1, engine="deepspeed")
    assert "tp_layout" not in deepspeed and deepspeed["deepspeed_config"].endswith("deepspeed.json")
    assert RunPlan.from_json(deepspeed).to_json() == deepspeed
    assert deepspeed["lean_loss"] is True and RunPlan.from_json(deepspeed).lean_loss      # whole logits, any engine
    # a file without the key (written before it) runs torch's loss
    assert not RunPlan.from_json({k: v for k, v in deepspeed.items() if k != "lean_loss"}).lean_loss


@pytest.mark.parametrize(("change", "message"), [
    ({"tp": "2"}, '"tp" must be an integer >= 1, got \'2\''),
    ({"offload": 0}, '"offload" must be true or false, got 0'),
    ({"engine": "jax"}, "plan engine 'jax' is unknown: use one of torch, deepspeed"),
    ({"device": "tpu"}, "plan device 'tpu' is unknown"),
    ({"tp_layuot": {}}, "unknown field 'tp_layuot'"),
    ({"dp": 2}, 'dp 2 x tp 2 x pp 1 must equal "devices" 2'),
    ({"gradient_accumulation": 3}, 'micro_batch 1 x gradient_accumulation 3 x dp 1 must equal "global_batch" 4'),
    ({"vocab_parallel": {"enabled": "yes"}}, "field 'vocab_parallel.enabled' must be true or false"),
    ({"lean_loss": 1}, "field 'lean_loss' must be true or false"),
    ({"predicted": {"iteration_time_s": "fast"}}, "field 'predicted.iteration_time_s' must be a number"),
])
def test_a_bad_field_is_one_line_naming_it(gpt_graph, tmp_path, change, message):
    written = _written(gpt_graph, tmp_path, tp=2)
    with pytest.raises(TensorOptError) as error:
        RunPlan.from_json(written | change, "run/plan.json")
    assert str(error.value).startswith("run/plan.json: ") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_bad_tp_layout_or_strategy_names_where(gpt_graph, tmp_path):
    written = _written(gpt_graph, tmp_path, tp=2)
    branch = dict(written["tp_layout"]["layers.*"][0])
    del branch["row"]
    with pytest.raises(TensorOptError, match=r"field 'tp_layout.layers.\*\[0\].row' is missing"):
        RunPlan.from_json(written | {"tp_layout": {"layers.*": [branch]}})
    blocks = [{"block": "layers.*", "strategies": [{"recompute": "some", "sequence_parallel": True, "copies": 4}]}]
    with pytest.raises(TensorOptError, match=r'block layers.\*: "recompute" must be one of none, selective, full, '
                                             r"got 'some'"):
        RunPlan.from_json(written | {"blocks": blocks})


def test_a_worker_stops_in_one_line_on_a_bad_plan_json(gpt_graph, tmp_path, monkeypatch):
    """``parallelize`` reads plan.json once, first: a bad file stops it before any process group is joined."""
    written = _written(gpt_graph, tmp_path, tp=2)
    (tmp_path / "bad.json").write_text(json.dumps(written | {"zero": 4}))
    monkeypatch.setenv("TENSOROPT_PLAN", str(tmp_path / "bad.json"))
    with pytest.raises(TensorOptError, match=r'bad.json: "zero" must be a ZeRO stage 0-3, got 4'):
        tensoropt.parallelize(torch.nn.Linear(2, 2), example_inputs=torch.ones(1, 2), global_batch=4)
    assert not torch.distributed.is_initialized()
