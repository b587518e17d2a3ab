"""DeepSpeed's own memory: the bucket sizes the config writes, the buffers the cost model prices for them, the
tracker's names for DeepSpeed's tensors, and one real two-worker run whose tracked peak the prediction bounds
from above by at most 5% (``benchmarks/_memory_deepspeed.py`` measures every ZeRO stage and offload)."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import LAUNCH_CWD
from workers import ENV, GPT_SCRIPT, tensoropt_cli

import tensoropt
from tensoropt.cost.deepspeed_memory import (
    PREFETCH_BUCKET_DEFAULT,
    REDUCE_BUCKET_DEFAULT,
    bucket_sizes,
    extra_bytes,
    largest_tied_parameter,
)
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.cost.torch_memory import LEAN_LOSS_TOKEN_BYTES, loss_forward_bytes, loss_gradient_bytes
from tensoropt.runtime.engines.deepspeed_tensors import host_gradients, role_of
from tensoropt.runtime.engines.ds_config import deepspeed_config
from tensoropt.search.ft import SearchSpace, search
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

TINY_GPT = {"family": "gpt", "hidden_size": 64, "num_layers": 4, "num_attention_heads": 4,
            "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 256}


def _plan(**change) -> Plan:
    base = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=8, zero=1, precision="bf16-mixed",
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 4),)),))
    return dataclasses.replace(base, **change)


def _model(write_json) -> ModelCost:
    graph = tensoropt.capture(write_json("m.json", TINY_GPT)).graph
    return ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb")))


def test_bucket_sizes_are_deepspeeds_defaults_capped_at_the_model():
    """A 42M-parameter model gets buckets of its size, a 2B one DeepSpeed's 5e8; overlap_comm as DeepSpeed
    defaults it (ZeRO 3 only), the prefetch bucket under ZeRO 3 only; nothing without a size."""
    assert bucket_sizes(1, 42_000_000) == {"reduce_bucket_size": 42_000_000, "allgather_bucket_size": 42_000_000,
                                           "overlap_comm": False}
    assert bucket_sizes(3, 2_000_000_000) == {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                                              "overlap_comm": True, "stage3_prefetch_bucket_size": 50_000_000}
    assert bucket_sizes(2, None) == {}


def test_deepspeed_reads_the_bucket_sizes_written():
    """DeepSpeed 0.19.8's own parser reads the sizes back (its models refuse unknown keys)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    parsed = DeepSpeedConfig(deepspeed_config(_plan(devices=1, dp=1, global_batch=4), 1_234_567))
    assert parsed.zero_config.reduce_bucket_size == 1_234_567 and parsed.zero_config.allgather_bucket_size == 1_234_567
    assert parsed.zero_config.overlap_comm is False


def test_tracker_names_deepspeeds_attributes_by_role():
    assert role_of("single_partition_of_fp32_groups") == "optimizer"
    assert role_of("fp32_partitioned_groups_flat") == "optimizer"
    assert role_of("averaged_gradients") == "gradients" and role_of("fp32_groups_gradients_flat") == "gradients"
    assert role_of("bit16_groups_flat") == "parameters" and role_of("lp_param_buffer") == "parameters"
    assert role_of("ipg_buckets") == "temporaries"
    assert role_of("single_partition_of_fp32_groups", offloading=True) == "offloaded"
    assert role_of("temp_grad_buffer_for_gpu_offload", offloading=True) == "gradients"     # on the device


def test_zero1_adds_one_reduce_bucket_of_the_models_gradients(write_json):
    """A ZeRO 1 bf16-mixed plan on DeepSpeed prices the states as an engine-free plan does, plus the reduction
    bucket DeepSpeed allocates whole in the backward, min(5e8, parameters) bf16 elements, and the largest parameter's
    fresh bf16 gradient beside its accumulated one (its step's working set, 4 + 4 bytes per parameter of a half
    partition less the 2 bytes of gradients it frees, is smaller)."""
    model = _model(write_json)
    params = model.graph.num_parameters
    largest = max(meta.numel for _, meta in model.graph.params)
    torch_plan, deepspeed_plan = _plan(), _plan(engine="deepspeed")
    extra = estimate(model, deepspeed_plan).memory_breakdown["other_bytes"] - \
        estimate(model, torch_plan).memory_breakdown["other_bytes"]
    assert extra == pytest.approx(2 * min(REDUCE_BUCKET_DEFAULT, params) + 2 * largest, rel=1e-12)
    # ZeRO 0's BF16_Optimizer: a float32 copy of every gradient and AdamW's square-root list at the step (8 bytes per
    # parameter), the bf16 gradients kept, activations (of micro-batches of 1 here: fewer than 8 bytes per parameter)
    # freed
    zero0 = estimate(model, dataclasses.replace(deepspeed_plan, zero=0, micro_batch=1)).memory_breakdown
    plain0 = estimate(model, dataclasses.replace(torch_plan, zero=0, micro_batch=1)).memory_breakdown
    assert 8 * params - zero0["activations_bytes"] > 0
    assert zero0["other_bytes"] - plain0["other_bytes"] == pytest.approx(8 * params - zero0["activations_bytes"],
                                                                         rel=1e-9)


def test_search_prices_deepspeed_plans_as_estimate(write_json):
    """The planner's vectorised prices of DeepSpeed plans (every stage, offload) equal ``estimate``'s."""
    model = _model(write_json)
    space = SearchSpace(global_batch=8, engine="deepspeed", precision="bf16-mixed", dtype="bfloat16", offload=True,
                        pipeline_stages=(1,), tensor_parallel=(1,), max_virtual_stages=1)
    points = search(model, 2, space).points
    assert {p.plan.engine for p in points} == {"deepspeed"}
    for point in points:
        assert estimate(model, point.plan).peak_memory_bytes == pytest.approx(point.peak_memory_bytes, rel=1e-12)
    plain = search(model, 2, dataclasses.replace(space, engine="")).points
    assert min(p.peak_memory_bytes for p in points) > min(p.peak_memory_bytes for p in plain)


def test_zero3_offload_keeps_no_gradient_partition_on_the_device(write_json):
    """ZeRO 3 with the optimizer offloaded: DeepSpeed allocates the gradient partitions on the host, so the
    device's price drops by the optimizer states and the priced gradient partition, nothing else."""
    model = _model(write_json)
    plan = _plan(zero=3, engine="deepspeed")
    kept = estimate(model, plan).memory_breakdown
    offloaded = estimate(model, dataclasses.replace(plan, offload=True)).memory_breakdown
    assert kept["gradients_bytes"] > 0 and offloaded["optimizer_bytes"] == 0
    assert offloaded["other_bytes"] - kept["other_bytes"] == pytest.approx(-kept["gradients_bytes"], rel=1e-12)


def _extra(zero: int, params: float, **change) -> float:
    """``extra_bytes`` of a bf16-mixed plan on two ranks (2-byte weights and gradients, float32 AdamW)."""
    args = {"zero": np.array([zero]), "offload": np.array([False]), "params": np.array([params]),
            "dp": np.array([2]), "weight_bytes": 2, "grad_bytes": 2, "master_bytes": 4, "moment_bytes": 4,
            "partition_copy": 0, "grads": np.array([2 * params]), "activations": np.array([0.0])} | change
    return float(extra_bytes(**args)[0])


def test_zero3_forward_holds_the_prefetched_weights_twice():
    """ZeRO 3's forward: the bucket, the gathered weights and the prefetch's flat all-gather output (at most
    ``stage3_prefetch_bucket_size`` elements), less the loss's gradients the forward does not hold yet."""
    small, large, held = 40e6, 400e6, np.array([1e9])    # activations: the reduction after the backward is less
    assert _extra(3, small, activations=held) == pytest.approx(3 * 2 * small)
    assert _extra(3, large, activations=held) == pytest.approx(2 * 2 * large + 2 * PREFETCH_BUCKET_DEFAULT)
    assert _extra(3, small, activations=held, loss_gradients=np.array([1e6])) == pytest.approx(3 * 2 * small - 1e6)
    # a recomputed block's forward makes its activations: only the loss's gradients beyond them are left out
    assert _extra(3, small, activations=held, transient=np.array([4e5]), loss_gradients=np.array([1e6])) == \
        pytest.approx(3 * 2 * small - 6e5)
    # the loss's forward holds its float32 logits (the copy log_softmax reads) beside what it saves: the larger of
    # that and a recomputed block's working set is held (a bf16 stream made the block's the smaller)
    assert _extra(3, small, activations=held, transient=np.array([4e5]), loss_gradients=np.array([1e6]),
                  loss_forward=np.array([5e5])) == pytest.approx(3 * 2 * small - 5e5)
    # a model larger than the reduce bucket reduces (and flattens) a full bucket within the backward
    huge = 2 * REDUCE_BUCKET_DEFAULT
    assert _extra(3, huge, activations=held) == pytest.approx(2 * 2 * REDUCE_BUCKET_DEFAULT + 2 * huge)


def test_the_loss_forward_holds_one_float32_logits_and_so_does_the_lean_loss(write_json):
    """Per micro-batch of 2 on TINY_GPT (sequence 64, vocabulary 256): the forward's float32 logits, beside the token
    ids and targets (int64) and the loss's two scalars. TINY_GPT's loss is one ``F.cross_entropy`` on rows of logits,
    so every engine runs it lean (``RunPlan.lean_loss``): its moment is that forward's, with what the model's frames
    still hold (the embedding's and the blocks' outputs) and its per-token vectors, not torch's backward's two
    float32 logit-sized gradients (``tests/test_vocab_loss.py`` prices both)."""
    model = _model(write_json)
    tokens = 2 * 64
    logits = tokens * 256
    targets = 2 * tokens * 8 + 2 * 4
    assert model.vocab.fused_loss and model.vocab.logit_bytes == 2          # bf16 logits (a bf16-mixed capture)
    assert loss_forward_bytes(model, 1, 2) == 4 * logits + targets
    # the lean loss's forward: the float32 copy the loss reads and the head's bf16 logits beside it
    assert loss_gradient_bytes(model, 1, 2) == \
        (4 + 2) * logits + 2 * 2 * model.carried_bytes + LEAN_LOSS_TOKEN_BYTES * tokens + targets


def test_a_tied_weights_gradients_are_held_three_times_at_the_end_of_the_backward(write_json):
    """The GPT family ties its embedding and head: that weight is the tied one; a LLaMA has none. ZeRO 1's end
    of the backward holds the bucket and three of the tied weight's gradients, once activations and the loss's
    gradients are freed."""
    gpt = tensoropt.capture(write_json("gpt.json", TINY_GPT)).graph
    llama = tensoropt.capture(write_json("llama.json", TINY_GPT | {"family": "llama"})).graph
    embedding = TINY_GPT["vocab_size"] * TINY_GPT["hidden_size"]
    assert largest_tied_parameter(gpt) == embedding and largest_tied_parameter(llama) == 0
    params, tied = 1e6, 3e5
    end = 2 * params + 3 * 2 * tied
    assert _extra(1, params, largest_tied=tied, activations=np.array([1e5]), loss_gradients=np.array([2e5])) == \
        pytest.approx(end - 3e5)
    # with more activations the backward's own peak (the bucket and one fresh gradient) is the larger
    assert _extra(1, params, largest_tied=tied, largest_parameter=tied, activations=np.array([1.5e6])) == \
        pytest.approx(2 * params + 2 * tied)


def test_the_host_partitions_gradients_are_offloaded():
    """ZeRO 3 keeps a host gradient on each float32 partition (``.grad``): the tracker names it offloaded."""
    partition = torch.zeros(8, requires_grad=True)
    partition.grad = torch.ones(8)
    assert [g is partition.grad for g in host_gradients([partition, torch.zeros(2)])] == [True]


# benchmarks/_memory_deepspeed.py's model, whose states dominate: 12 layers of hidden 512, vocabulary 8192 (42.1M
# parameters; at 4.2M, activations and the backward's working set weigh more and ZeRO 3 was priced 5.4% above)
# Run at one sample of 32 tokens per rank: its states are what the test weighs, and compute in bf16 on a CPU is
# slow (a loaded AVX2 core: under 1 GFLOP/s), so 8 samples of 64 tokens made this one test take minutes.
MEASURED_ARGS = ["--hidden", "512", "--layers", "12", "--heads", "8", "--vocab", "8192", "--seq-len", "32",
                 "--global-batch", "2", "--meta", "--foreach"]


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_predicted_memory_bounds_a_real_deepspeed_zero3_run(tmp_path):
    """ZeRO 3 bf16-mixed on two CPU workers, tracked (TENSOROPT_MEMORY_OUT): the launcher's prediction less the
    runtime overhead is at least the larger rank's peak tensor bytes and at most 5% above it. Two steps: the tracker
    records the second (runtime.memory.check.TRACKED_STEPS; a third ran untracked, ~6.5 s of bf16 backward on a CPU
    without bf16 matrix units)."""
    plan = _plan(zero=3, micro_batch=1, global_batch=2, blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 12),)),))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", path, "--engine",
                           "deepspeed", "--precision", "bf16-mixed", "--run-dir", tmp_path / "run", "--",
                           *MEASURED_ARGS, "--steps", 2, cwd=LAUNCH_CWD,
                           env=ENV | {"TENSOROPT_MEMORY_OUT": str(tmp_path / "memory-{rank}.json")})
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    config = json.loads((tmp_path / "run" / "deepspeed.json").read_text())
    assert config["zero_optimization"]["reduce_bucket_size"] < REDUCE_BUCKET_DEFAULT     # capped at the model
    peak = max(json.loads((tmp_path / f"memory-{r}.json").read_text())["peak_bytes"] for r in range(2))
    from launcher.devices import detect
    predicted = written["predicted"]["peak_memory_bytes"] - detect("cpu", 2, None).profile.runtime_overhead_bytes
    assert peak <= predicted <= 1.05 * peak, (predicted, peak, np.round(predicted / peak - 1, 4))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_deepspeed_below_zero3_reduces_on_the_compute_stream(write_json, zero):
    """The config leaves ``overlap_comm`` off below ZeRO 3 (DeepSpeed's default), where DeepSpeed issues its
    reductions on the compute stream: its plans expose all of their data-parallel communication, which the torch
    engine's plans hide behind the backward. ZeRO 3 overlaps as FSDP2 does."""
    model = _model(write_json)
    assert deepspeed_config(_plan(zero=zero), 1000)["zero_optimization"]["overlap_comm"] is (zero == 3)
    ds = estimate(model, _plan(zero=zero, engine="deepspeed")).time_breakdown
    torch_engine = estimate(model, _plan(zero=zero)).time_breakdown
    assert ds["data_parallel_comm_s"] == torch_engine["data_parallel_comm_s"] > 0
    assert torch_engine["data_parallel_exposed_s"] < torch_engine["data_parallel_comm_s"]
    if zero < 3:
        assert ds["data_parallel_exposed_s"] == ds["data_parallel_comm_s"]
    else:
        assert ds["data_parallel_exposed_s"] == torch_engine["data_parallel_exposed_s"]
