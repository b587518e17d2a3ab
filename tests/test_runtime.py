"""The runtime's pure parts: which engine runs a plan, the DeepSpeed config it writes, the frontier
the launcher chooses from, and the one-process path of ``tensoropt.parallelize``."""

import dataclasses

import pytest
import torch
from conftest import SMALL_GPT

import tensoropt
from launcher.launch import Devices, runnable_front
from tensoropt.cost.profile import load_profile
from tensoropt.errors import TensorOptError
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime import choose_engine, unsupported
from tensoropt.runtime.engines.ds_config import deepspeed_config
from tensoropt.runtime.run import Run
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan


def _plan(**change) -> Plan:
    base = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=8, zero=0, offload=False,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("full"), 1), (LayerStrategy("none"), 3))),))
    return dataclasses.replace(base, **change)


def test_the_plan_decides_the_engine():
    assert choose_engine(_plan()) == "torch"
    assert choose_engine(_plan(zero=1)) == "torch"                           # FSDP2 without sync until the last
    assert choose_engine(_plan(zero=2, offload=True)) == "deepspeed"         # optimizer offload is DeepSpeed's
    assert choose_engine(_plan(dp=1, tp=2, micro_batch=8)) == "torch"        # TP is torch's
    assert choose_engine(_plan(), "deepspeed") == "deepspeed"
    with pytest.raises(TensorOptError, match="needs optimizer offload, which the torch engine does not apply"):
        choose_engine(_plan(zero=1, offload=True), "torch")
    selective = _plan(blocks=(BlockPlan("layers.*", ((LayerStrategy("selective"), 4),)),))
    assert choose_engine(selective) == "torch" and not unsupported(selective, "deepspeed")
    assert unsupported(_plan(dp=1, pp=2, micro_batch=2), "deepspeed") == ["pipeline stages"]


def test_deepspeed_config_says_what_the_plan_says():
    config = deepspeed_config(_plan(zero=3, micro_batch=1, offload=True))
    assert config["train_batch_size"] == 8 and config["train_micro_batch_size_per_gpu"] == 1
    assert config["gradient_accumulation_steps"] == 4                        # 8 samples / (2 ranks x 1)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert "activation_checkpointing" in config                             # one copy is recomputed
    assert "optimizer" not in config                                         # the script's optimizer is used
    plain = deepspeed_config(_plan(blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 4),)),)))
    assert "activation_checkpointing" not in plain and plain["zero_optimization"] == {"stage": 0}


def test_deepspeed_config_trains_a_bf16_model_in_the_precision_it_was_priced_in():
    """bf16 weights, gradients and communication, float32 master weights and AdamW states (2 + 2 + 12 bytes per
    parameter); a float32 model keeps DeepSpeed's float32 mode. Read back by DeepSpeed 0.19.8's own parser, whose
    models refuse unknown keys, so the keys are the ones it reads."""
    from deepspeed.runtime.config import DeepSpeedConfig
    bf16 = deepspeed_config(_plan(dtype="bfloat16", zero=1))
    assert bf16["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False,
                            "check_grad_overflow": False}
    assert bf16["data_types"] == {"grad_accum_dtype": "bf16"}
    single = _plan(dtype="bfloat16", zero=1, devices=1, dp=1)       # DeepSpeedConfig checks one process
    parsed = DeepSpeedConfig(deepspeed_config(single))
    assert parsed.bfloat16_config.enabled and not parsed.bfloat16_config.bf16_master_weights_and_grads
    assert not parsed.float16_config.enabled and parsed.grad_accum_dtype == "bf16"
    fp32 = deepspeed_config(_plan(dtype="float32", zero=3))
    assert "bf16" not in fp32 and "fp16" not in fp32 and "data_types" not in fp32
    assert not DeepSpeedConfig(deepspeed_config(_plan(dtype="float32", devices=1, dp=1))).bfloat16_config.enabled


def test_launcher_front_is_pareto_and_every_point_runs_on_its_engine(write_json):
    from tensoropt.api import capture
    graph = capture(write_json("gpt.json", SMALL_GPT), batch_size=1, seq_len=32).graph
    graph = dataclasses.replace(graph, metadata=graph.metadata + (("global_batch", "8"),))
    devices = Devices("cpu", 2, 2**34, load_profile("cpu-2core"))
    front = runnable_front(graph, devices, 2)
    engines = {engine for _, engine in front}
    assert front and engines <= {"torch", "deepspeed"}
    for point, engine in front:
        assert not unsupported(point.plan, engine)
        assert point.plan.dtype == graph.params[0][1].dtype               # planned in the precision it trains in
        # the torch engine trains bf16 weights in bf16; DeepSpeed's ZeRO optimizer keeps float32 partitions
        assert point.plan.master_weights == (engine == "deepspeed")
    times = [p.iteration_time_s for p, _ in front]
    memories = [p.peak_memory_bytes for p, _ in front]
    assert times == sorted(times) and memories == sorted(memories, reverse=True)
    assert len(set(memories)) == len(memories)                               # strictly better memory each step
    only_ds = runnable_front(graph, devices, 2, "deepspeed")
    assert {engine for _, engine in only_ds} == {"deepspeed"}


def test_a_given_plan_is_priced_for_this_model_and_these_devices(write_json):
    from launcher.launch import price
    from tensoropt.api import capture
    from tensoropt.cost.model import ModelCost, estimate
    from tensoropt.cost.profile import Cluster
    from tensoropt.graph.fold import fold
    graph = capture(write_json("gpt.json", SMALL_GPT), batch_size=1, seq_len=32).graph
    devices = Devices("cuda", 2, 80 * 2**30, load_profile("h100-80gb"))
    plan = _plan(zero=2, master_weights=True)
    priced = price(graph, devices, 2, plan, "torch", "bf16-mixed")
    expected = estimate(ModelCost(graph, fold(graph), Cluster(2, 2, devices.profile)),
                        dataclasses.replace(plan, master_weights=False, precision="bf16-mixed"))
    # the torch engine's bf16-mixed keeps the weights themselves in float32: no separate master copy
    assert (priced.plan.master_weights, priced.plan.dtype, priced.plan.precision) == (False, "bfloat16", "bf16-mixed")
    assert (priced.iteration_time_s, priced.peak_memory_bytes) == (expected.iteration_time_s,
                                                                   expected.peak_memory_bytes)
    # ZeRO 2: FSDP2 keeps float32 gradient shards (4/dp bytes per parameter), DeepSpeed's bf16 mode bf16 ones (2/dp)
    # (DeepSpeed's reduction buckets, priced in other_bytes, are its own: cost.deepspeed_memory)
    model = ModelCost(graph, fold(graph), Cluster(2, 2, devices.profile))
    on_deepspeed = price(graph, devices, 2, plan, "deepspeed", "bf16-mixed").plan
    assert estimate(model, on_deepspeed).memory_breakdown["gradients_bytes"] < \
        estimate(model, priced.plan).memory_breakdown["gradients_bytes"]
    assert price(graph, devices, 2, plan, "torch", "32-true").plan.dtype == "float32"


def test_parallelize_alone_trains_one_process_as_the_plain_loop():
    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                            vocab_size=64)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    plain = DecoderLM(cfg)
    wrapped = DecoderLM(cfg)
    wrapped.load_state_dict(plain.state_dict())
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    _, _, run = tensoropt.parallelize(wrapped, lambda p: torch.optim.SGD(p, lr=0.1), example_inputs=batch,
                                      global_batch=4)
    for _ in range(2):
        optimizer.zero_grad()
        expected = plain(*batch)
        expected.backward()
        optimizer.step()
        assert run.train_step(batch) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert (run.engine, run.dp_size, run.grad_accumulation) == ("none", 1, 1)
    loss = run.train_step(batch, sync=False)              # the loss left on the device: a 0-dim float32 tensor
    assert isinstance(loss, torch.Tensor) and loss.shape == () and loss.dtype == torch.float32


def test_a_rank_loads_its_rows_of_the_global_batch():
    """``local_rows``: rank r of dp takes rows [r g/dp, (r + 1) g/dp); a global batch that dp does not split is one
    line; with ``local=True`` the batch given is that share, split into the plan's micro-batches as it is."""
    run = Run(dp_rank=1, dp_size=2, global_batch=8, grad_accumulation=2)
    assert run.local_rows() == range(4, 8) and run.local_rows(16) == range(8, 16)
    with pytest.raises(TensorOptError, match="a global batch of 7 samples does not split into 2"):
        run.local_rows(7)
    whole, share = torch.arange(8), torch.arange(4, 8)
    assert [b.tolist() for b in run.local_batches(whole)] == [b.tolist() for b in run.local_batches(share, local=True)]
    assert [b.tolist() for b in run.local_batches(share, local=True)] == [[4, 5], [6, 7]]


def test_a_model_that_returns_no_loss_is_one_line():
    model = torch.nn.Linear(4, 2)
    _, _, run = tensoropt.parallelize(model, lambda p: torch.optim.SGD(p, lr=0.1), example_inputs=torch.ones(1, 4),
                                      global_batch=2)
    with pytest.raises(TensorOptError, match=r"forward returns a Tensor\[2, 2\]: return only the loss"):
        run.train_step(torch.ones(2, 4))
