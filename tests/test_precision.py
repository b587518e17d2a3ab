"""Precisions named as PyTorch Lightning names them (issue 18 part 6): ``--precision bf16-mixed | bf16-true |
32-true``, what the planner prices for each engine, and real 2-worker runs that train to the losses of the
script run alone in the same precision (``TENSOROPT_PRECISION``)."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import EXAMPLES, LAUNCH_CWD, SMALL_GPT
from workers import ENV, LOSS_RTOL, assert_weights_alike, launched_once, launched_with_plan, tensoropt_cli

import tensoropt
from launcher.launch import Devices, check_precision, price
from tensoropt.api import capture
from tensoropt.cost.model import ModelCost, estimate, state_bytes
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.graph.fold import fold
from tensoropt.runtime import unsupported
from tensoropt.runtime.engines.ds_config import deepspeed_config
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

GPT = str(EXAMPLES / "train_gpt.py")
LAYERS = 2
BLOCKS = (BlockPlan("layers.*", ((LayerStrategy("none"), LAYERS),)),)


def _plan(precision: str = "bf16-mixed", **change) -> Plan:
    base = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=4, global_batch=8, zero=0, blocks=BLOCKS, master_weights=False,
                precision=precision)
    return dataclasses.replace(base, **change)


# ---- pricing: the bytes each engine holds under each precision --------------------------------------------------

@pytest.fixture(scope="module")
def small_gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt") / "gpt.json"
    path.write_text(json.dumps(SMALL_GPT))
    graph = capture(str(path), batch_size=1, seq_len=32).graph
    model = ModelCost(graph, fold(graph), Cluster(2, 2, load_profile("h100-80gb")))
    return graph, model


def _states(model: ModelCost, plan: Plan) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer, other) bytes per device the cost model gives ``plan`` (on SMALL_GPT's 4
    layers)."""
    plan = dataclasses.replace(plan, blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 4),)),))
    m = estimate(model, plan).memory_breakdown
    return m["parameters_bytes"], m["gradients_bytes"], m["optimizer_bytes"], m["other_bytes"]


def test_state_bytes_per_precision_and_engine():
    """Bytes per parameter (weights, gradients, optimizer states incl. a separate master partition) by precision,
    engine (DeepSpeed's bf16 mode keeps a float32 master copy: ``master_weights``) and ZeRO stage."""
    def held(master, precision, zero):
        s = state_bytes("bfloat16", master, precision, zero)
        return s.weight, s.gathered_bytes, s.grad, s.optimizer_bytes(zero), s.cast_copy
    assert held(False, "32-true", 0) == (4, 4, 4, 8, 0)
    assert held(False, "bf16-true", 0) == (2, 2, 2, 4, 0)
    assert held(False, "bf16-true", 2) == (2, 2, 2, 4 + 2, 0)        # the rank's bf16 partition beside the weights
    assert held(True, "bf16-mixed", 0) == (2, 2, 2, 12, 0)           # DeepSpeed bf16: 2 + 2 + 12
    assert held(False, "bf16-mixed", 0) == (4, 4, 4, 8, 2)           # DDP under autocast: + its bf16 weight copies
    assert held(False, "bf16-mixed", 2) == (2, 2, 4, 8 + 4, 0)       # FSDP2 ZeRO 2: bf16 gathered, float32 shard
    assert held(False, "bf16-mixed", 3) == (4, 2, 4, 8, 0)           # FSDP2 ZeRO 3: float32 shards, bf16 gathers


def test_priced_bytes_per_precision_for_a_known_parameter_count(small_gpt):
    """Exact model-state bytes per device for the small GPT (P parameters) on 2 devices, as each engine holds them."""
    graph, model = small_gpt
    p = float(sum(int(np.prod(meta.shape)) for _, meta in graph.params))
    base = _states(model, _plan("32-true"))[3]                 # transient buffers and the runtime's overhead
    assert _states(model, _plan("32-true")) == (4 * p, 4 * p, 8 * p, base)
    assert _states(model, _plan("bf16-true")) == (2 * p, 2 * p, 4 * p, base)
    assert _states(model, _plan("bf16-mixed")) == (4 * p, 4 * p, 8 * p, base + 2 * p)     # torch DDP + autocast
    ds = _plan("bf16-mixed", master_weights=True)
    assert _states(model, ds) == (2 * p, 2 * p, 12 * p, base)
    # FSDP2 ZeRO 2-3 hold gathered units and gradient buffers beyond the states (cost.torch_memory): in ``other``;
    # with one micro-batch the peak may come before FSDP2 has made any gradient shard (the backward's start)
    for plan, (weights, grads, optimizer) in ((_plan("bf16-mixed", zero=3), (4 * p / 2, 4 * p / 2, 8 * p / 2)),
                                              (_plan("bf16-mixed", zero=2), (2 * p, 4 * p / 2, 12 * p / 2)),
                                              (_plan("32-true", zero=3), (4 * p / 2, 4 * p / 2, 8 * p / 2))):
        held_weights, held_grads, held_optimizer, other = _states(model, plan)
        assert (held_weights, held_optimizer) == (weights, optimizer) and held_grads in (0.0, grads) and other > base


def test_compute_is_priced_in_the_precision_the_capture_ran_in(small_gpt):
    """The same plan in 32-true on a float32 capture takes longer than in bf16-true on a bf16 one (products at
    the bf16 peak, half the bytes moved): the launcher captures the script in the precision it plans."""
    graph, _ = small_gpt
    devices = Devices("cuda", 2, 80 * 2**30, load_profile("h100-80gb"))
    fp32 = price(graph, devices, 2, _plan(), "torch", "32-true")
    assert fp32.plan.dtype == "float32" and fp32.plan.precision == "32-true"
    mixed = price(graph, devices, 2, _plan(), "torch", "bf16-mixed")
    assert (mixed.plan.dtype, mixed.plan.master_weights) == ("bfloat16", False)
    assert price(graph, devices, 2, _plan(), "deepspeed", "bf16-mixed").plan.master_weights is True


def test_plan_precision_round_trips_and_old_plans_load_as_before():
    plan = _plan("bf16-true")
    assert Plan.from_json(plan.to_json()) == plan and plan.to_json()["precision"] == "bf16-true"
    old = _plan("", master_weights=True).to_json()
    assert "precision" not in old
    loaded = Plan.from_json(old)
    assert loaded.precision == "" and loaded.precision_name == "bf16-mixed"         # bf16 + master weights
    assert Plan.from_json(old | {"dtype": "float32"}).precision_name == "32-true"
    with pytest.raises(ValueError, match="not one of"):
        Plan.from_json(old | {"precision": "fp8"})


def test_deepspeed_config_per_precision():
    from deepspeed.runtime.config import DeepSpeedConfig
    single = {"devices": 1, "dp": 1}
    assert "bf16" not in deepspeed_config(_plan("32-true"))
    mixed = DeepSpeedConfig(deepspeed_config(_plan("bf16-mixed", zero=2, **single))).bfloat16_config
    assert mixed.enabled and not mixed.bf16_master_weights_and_grads
    pure = DeepSpeedConfig(deepspeed_config(_plan("bf16-true", zero=2, **single))).bfloat16_config
    assert pure.enabled and pure.bf16_master_weights_and_grads and pure.bf16_optimizer_states
    # DeepSpeed keeps float32 master weights without ZeRO: bf16-true is not its to run there
    assert unsupported(_plan("bf16-true"), "deepspeed") == ["bf16-true without ZeRO"]
    assert not unsupported(_plan("bf16-true", zero=2), "deepspeed")


def test_a_script_under_its_own_autocast_runs_bf16_mixed_only(small_gpt):
    graph, _ = small_gpt
    autocast = dataclasses.replace(graph, metadata=graph.metadata + (("autocast", "bfloat16"),))
    assert check_precision(autocast, "bf16-mixed") == "bf16-mixed"
    with pytest.raises(TensorOptError, match="own torch.autocast.*--precision bf16-mixed"):
        check_precision(autocast, "32-true")                                      # named on the command line
    assert check_precision(autocast, "32-true", named=False) == "bf16-mixed"      # a default gives way
    assert check_precision(graph, "32-true") == "32-true"


def test_parallelize_alone_applies_a_precision_only_when_asked(monkeypatch):
    """By hand with nothing set the model is the script's; ``TENSOROPT_PRECISION`` runs it in that precision."""
    def forward_dtype():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        model, _, _ = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p))
        dtype = next(model.parameters()).dtype
        return dtype, model(torch.ones(2, 4, dtype=dtype)).dtype
    monkeypatch.delenv("TENSOROPT_PRECISION", raising=False)
    assert forward_dtype() == (torch.float32, torch.float32)
    monkeypatch.setenv("TENSOROPT_PRECISION", "bf16-mixed")
    assert forward_dtype() == (torch.float32, torch.bfloat16)
    monkeypatch.setenv("TENSOROPT_PRECISION", "bf16-true")
    assert forward_dtype() == (torch.bfloat16, torch.bfloat16)
    monkeypatch.setenv("TENSOROPT_PRECISION", "fp8")
    with pytest.raises(TensorOptError, match="not a precision"):
        forward_dtype()


# ---- real workers: each precision trains as the script alone in it ---------------------------------------------

@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """run(precision, *script args) -> (losses, final parameters): the script run by hand in ``precision``
    (each run once per module)."""
    runs: dict[tuple, tuple[list[float], np.ndarray]] = {}

    def run(precision: str, *args) -> tuple[list[float], np.ndarray]:
        if (precision, *args) not in runs:
            folder = tmp_path_factory.mktemp("alone")
            subprocess.run([sys.executable, GPT, "--steps", "3", "--layers", str(LAYERS), "--out", folder / "out.json",
                            "--save-params", folder / "params.npy", *map(str, args)], check=True,
                           env={**ENV, "TENSOROPT_PRECISION": precision}, capture_output=True, timeout=300)
            runs[(precision, *args)] = (json.loads((folder / "out.json").read_text())["losses"],
                                        np.load(folder / "params.npy"))
        return runs[(precision, *args)]
    return run


def _launched(tmp_path, plan: Plan, engine: str, *args) -> tuple[list[float], np.ndarray]:
    """The launched run of ``plan`` (3 steps): its losses and final parameters (gathered, as float32). Torch-engine
    plans without a pipeline go through ``launched_once``: tests/test_memory_check.py reads the memory of the
    bf16-mixed ZeRO 3 run."""
    if engine == "torch" and plan.pp == 1:
        data = launched_once(plan, tmp_path, GPT, "--layers", str(LAYERS), *args)
    else:
        data = launched_with_plan(plan, tmp_path, plan.devices, GPT, "--layers", LAYERS, *args, engine=engine,
                                  params=True)
    assert f"model states: {plan.precision}" in data["stdout"]
    assert data["written"]["precision"] == plan.precision
    return data["losses"], data["params"]


def _in_bf16(params: np.ndarray) -> float:
    """The share of values exactly representable in bf16 (all of them for weights kept in bf16)."""
    values = torch.from_numpy(params)
    return float((values.bfloat16().float() == values).float().mean())


def _report(launched, alone) -> None:
    """Printed with -s: how far the launched losses are from the script's alone in its precision (the
    tolerances below were set from these)."""
    losses, reference = np.array(launched[0]), np.array(alone[0])
    print("loss deviation", np.max(np.abs(losses / reference - 1)), "first step", abs(losses[0] / reference[0] - 1))


def _first(launched, alone) -> float:
    """Relative difference of the first step's losses: one forward of the same initial weights."""
    return abs(launched[0][0] / alone[0][0] - 1)


# The first step is a forward of the same weights in both runs: in the same precision its loss differs only by
# the order of reductions (measured 1e-7 under DDP, whose forward is the script's alone; tensor parallelism sums
# its row-parallel halves in bf16 (2.4e-6), FSDP2 and DeepSpeed compute with bf16 embeddings and norm weights
# (1e-5), so their first steps are compared with 32-true's only), while the
# precisions differ there by 4e-6 (32-true vs bf16-mixed) to 1e-5 (bf16-mixed vs bf16-true) on this model. That
# is what tells the precision that ran; the later steps' differences are amplified alike for every cause by
# AdamW's first update (about lr times the sign of each gradient, whatever its size).
FIRST_STEP_RTOL = 1e-6
TP2 = {"dp": 1, "tp": 2, "tp_branches": ("attn", "mlp")}
# bf16-mixed against the script alone in bf16-mixed, 3 steps: measured largest relative deviations of the losses
# DDP 8.7e-6, FSDP2 ZeRO 3 2.4e-5, tensor parallel 3.1e-5 (vocabulary split too), DeepSpeed ZeRO 2 2.8e-5, pp2
# 8.7e-6, pp2 under ZeRO 1 2.8e-5 (FSDP2's bf16 weights, the stages traced with them: a bf16 stream, first step
# 9.9e-6 from the float32-weights run alone, as FSDP2's flat ZeRO 3); bounds ~3x. Products
# and their bf16 roundings are the same; what differs is the order of float32 reductions over the split batch or
# the sharded hidden dimension, which moves a bf16 rounding of a product's output now and then, plus FSDP2's bf16
# embedding and norm weights (autocast alone keeps those float32) and DeepSpeed's bf16 gradients and master
# weights made from bf16 values.
PP2 = {"dp": 1, "pp": 2, "blocks": (BlockPlan("layers.*", ((LayerStrategy("none"), LAYERS // 2),)),)}
MIXED = [("torch", {}, 3e-5), ("torch", {"zero": 3}, 7e-5), ("torch", TP2, 9e-5), ("deepspeed", {"zero": 2}, 9e-5),
         ("torch", PP2, 3e-5), ("torch", PP2 | {"zero": 1}, 7e-5)]


# bf16 gradients (FSDP2 ZeRO 1, reduce_dtype=bfloat16) against the script alone in bf16-mixed, 3 steps of two
# micro-batches of 2 per replica. The comparison accumulates (1) what every FSDP2 bf16-mixed run differs by (bf16
# embedding and norm weights, the order of float32 reductions over the split batch: FSDP2 ZeRO 3's bound above,
# 7e-5) and (2) per step, R = 2 bf16 roundings of each gradient element that float32 gradients do not make: the
# rank's two micro-batches summed in bf16 (autograd accumulates on the bf16 weights) and the two ranks' sum in the bf16
# reduce-scatter (AVG's halving is exact); each moves a value by at most u = 2^-8 of it (bf16's 8-bit significand).
# AdamW scales each element's update by its own gradient (m / sqrt(v)), so a relative error e of the gradients moves
# the updates, and the loss changes they make, by about e at most: the loss of step t moves by at most R u times the
# losses' movement before it (sum of |L(s+1) - L(s)| for s < t, the reference's own; an over-estimate, since on
# random tokens much of that movement is the batch's, not the update's). Measured on 2 AMD cores: 2.0e-5 at step 3,
# where the same plan with float32 gradients read 2.3e-5: the bf16 roundings do not show over 3 steps of lr 1e-3. So
# the test also asserts the workers were told bf16 gradients (the engine line and plan.json);
# tests/test_bf16_gradients.py holds a real rank's bf16 gradient bytes, and tests/test_memory_check.py this very
# launch's memory against its simulation.
BF16_GRADIENTS = {"zero": 1, "micro_batch": 2, "grad_dtype": "bfloat16"}
FSDP2_MIXED_RTOL, BF16_ROUNDINGS, BF16_UNIT_ROUNDOFF = 7e-5, 2, 2.0 ** -8


def _bf16_gradient_rtol(reference: list[float]) -> np.ndarray:
    """Per step, the bound derived above from the reference losses."""
    moved = np.concatenate([[0.0], np.cumsum(np.abs(np.diff(reference)))])
    return FSDP2_MIXED_RTOL + BF16_ROUNDINGS * BF16_UNIT_ROUNDOFF * moved / np.abs(reference)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_bf16_gradients_train_as_the_script_alone_in_bf16_mixed(tmp_path, alone):
    plan = _plan("bf16-mixed", **BF16_GRADIENTS)
    assert plan.grad_accumulation == 2 and "grad:bf16" in plan.summary()
    launched, reference = _launched(tmp_path, plan, "torch"), alone("bf16-mixed")
    run = launched_once(plan, tmp_path, GPT, "--layers", str(LAYERS))            # the same launch, its output
    assert "reduce_dtype=bfloat16" in run["stdout"] and run["written"]["grad_dtype"] == "bfloat16"
    _report(launched, reference)
    deviation = np.abs(np.array(launched[0]) / np.array(reference[0]) - 1)
    assert np.all(deviation <= _bf16_gradient_rtol(reference[0])), (deviation, _bf16_gradient_rtol(reference[0]))
    assert _first(launched, alone("32-true")) > FIRST_STEP_RTOL                # it computed in bf16
    assert _in_bf16(launched[1]) < 0.5                                          # float32 master weights, as alone


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("engine,change,rtol", MIXED, ids=["ddp", "fsdp2-zero3", "tp2", "deepspeed-zero2", "pp2",
                                                             "pp2-zero1"])
def test_bf16_mixed_trains_as_the_script_alone_in_bf16_mixed(tmp_path, alone, engine, change, rtol):
    launched = _launched(tmp_path, _plan("bf16-mixed", **change), engine)
    _report(launched, alone("bf16-mixed"))
    np.testing.assert_allclose(launched[0], alone("bf16-mixed")[0], rtol=rtol)
    assert _first(launched, alone("32-true")) > FIRST_STEP_RTOL                # it computed in bf16
    if not change or change is PP2:     # autocast over float32 weights, as alone; only the batch's mean is split
        assert _first(launched, alone("bf16-mixed")) < FIRST_STEP_RTOL
    # the weights the script gets back: float32 masters in the torch engine, DeepSpeed's bf16 copies of them
    assert (_in_bf16(launched[1]) == 1.0) == (engine == "deepspeed")


# bf16-true against the script alone in bf16-true, 3 steps: measured largest relative deviations of the losses
# DDP 2.5e-6, FSDP2 ZeRO 3 2.5e-6, DeepSpeed ZeRO 2 2.5e-6 (bf16 products, bf16 gradients reduced over two ranks,
# AdamW on bf16 weights: the split batch moves one bf16 rounding of a gradient now and then); bound 4x.
# Tensor parallel (tp2, vocabulary split too) 5.1e-5, first step 9.8e-7: each rank rounds its partial output of a
# row-parallel linear to bf16 before the bf16 all-reduce sums the halves, and likewise its partial input gradient
# of a column-parallel one (what Megatron-LM's bf16 tensor parallelism does too). The script alone with just those
# roundings added in one process (benchmarks/tp_bf16_roundings.py: row linears as two input-feature halves each
# rounded to bf16, then summed; column linears' input gradients likewise) lands 9.8e-8 from the launched first step
# and moves the 3-step losses by 3.3e-5: the same order, so the deviation is the layout's, not a precision applied
# wrongly; bound 3x. Its
# first step stays clear of the other precisions' (32-true 4.8e-6, bf16-mixed 8.9e-6): that is what tells them
# apart, since over 3 steps the precisions move this model's losses by only 1.2e-5 to 3.3e-5.
TP_FIRST_STEP_RTOL = 3e-6
TRUE = [("torch", {}, 1e-5), ("torch", {"zero": 3}, 1e-5), ("torch", TP2, 1.5e-4), ("deepspeed", {"zero": 2}, 1e-5)]


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("engine,change,rtol", TRUE, ids=["ddp", "fsdp2-zero3", "tp2", "deepspeed-zero2"])
def test_bf16_true_trains_as_the_script_alone_in_bf16_true(tmp_path, alone, engine, change, rtol):
    launched = _launched(tmp_path, _plan("bf16-true", **change), engine)
    _report(launched, alone("bf16-true"))
    np.testing.assert_allclose(launched[0], alone("bf16-true")[0], rtol=rtol)
    first = TP_FIRST_STEP_RTOL if change is TP2 else FIRST_STEP_RTOL
    assert _first(launched, alone("bf16-true")) < first < min(_first(launched, alone(p)) for p in ("bf16-mixed",
                                                                                                     "32-true"))
    assert _in_bf16(launched[1]) == 1.0                                    # no float32 copy was ever updated


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_32_true_trains_a_bf16_built_model_in_float32(tmp_path, alone):
    """The script builds its model in bf16; 32-true casts it to float32 before DDP wraps it: float32 training,
    to the script's losses and final parameters alone in 32-true (measured: 1e-7 and 2e-6)."""
    launched = _launched(tmp_path, _plan("32-true"), "torch", "--dtype", "bfloat16")
    reference = alone("32-true", "--dtype", "bfloat16")
    _report(launched, reference)
    np.testing.assert_allclose(launched[0], reference[0], rtol=LOSS_RTOL)
    assert_weights_alike(launched[1], reference[1], steps=3)
    assert _in_bf16(launched[1]) < 0.5


@pytest.mark.slow
def test_a_meta_built_model_gets_a_bf16_mixed_pipeline(tmp_path):
    """bf16-mixed pipeline stages of a meta-built model are traced on fake CPU tensors under the CPU's autocast
    (runtime.pipeline.trace; trained in tests/test_pipeline.py): the launcher offers them."""
    mixed = tensoropt_cli("launch", GPT, "--device", "cpu", "--gpus", 2, "--pp", 2, "--precision", "bf16-mixed",
                          "--dry-run", "--run-dir", tmp_path, "--", "--meta", "--layers", LAYERS, cwd=LAUNCH_CWD)
    assert mixed.returncode == 0 and "chosen: dp1 tp1 pp2" in mixed.stdout, mixed.stderr[-2000:]


@pytest.mark.parametrize("fake", [False, True])
def test_casting_a_model_keeps_its_tied_weights_tied(fake):
    """bf16-mixed casts a bf16-built model to float32 weights before anything else; its tied embedding and head stay
    one parameter, also on meta under the memory simulation's FakeTensorMode (where the cast comes back as a fake
    tensor that cannot replace the old one's data in place, so each name got its own parameter)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tensoropt.models.transformer import DecoderLM, TransformerConfig
    from tensoropt.runtime.engines.precision import cast_model
    with torch.device("meta"):
        model = DecoderLM(TransformerConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
                                            seq_length=16, vocab_size=64)).to(torch.bfloat16)
    assert model.head.weight is model.embed.weight
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device("meta"):
        cast_model(model, "bf16-mixed")
    assert model.head.weight is model.embed.weight and model.embed.weight.dtype == torch.float32
