"""ZeRO 1 in the torch engine (issue 18 part 5): FSDP2 with the parameters kept gathered and gradient sync only on
the step's last micro-batch (whole weights and gradients, optimizer states and float32 shards over dp), alone,
inside pipeline stages and over a (dp, tp) mesh; what the planner prices for it; real workers over gloo train
to the losses of the script run alone (float32, rtol 2e-5)."""

import dataclasses

import numpy as np
import pytest
import torch
from workers import GPT_SCRIPT, LOSS_RTOL, dry_run_plan, launched_with_plan, tp2

from tensoropt.cost.model import estimate, state_bytes
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.engines.torch_engine import apply
from tensoropt.runtime.parallel.data_parallel import fsdp_micro_batch
from tensoropt.search.engines import ENGINE_SPACES, choose_engine, unsupported
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan
from tensoropt.space.run_plan import RunPlan

LAYERS = 2
BLOCKS = (BlockPlan("layers.*", ((LayerStrategy("none"), LAYERS),)),)


def _plan(precision: str, **change) -> Plan:
    base = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=8, zero=1, blocks=BLOCKS,
                master_weights=False, precision=precision)
    return dataclasses.replace(base, **change)


# ---- the planner: torch runs ZeRO 1, priced as FSDP2 holds it ----------------------------------------------------

def test_the_torch_engine_runs_zero1_plans():
    assert 1 in ENGINE_SPACES["torch"]["zero_stages"]
    for change in [{}, dict(devices=4, pp=2), dict(devices=4, tp=2, tp_branches=("attn",))]:
        plan = _plan("32-true", **change)
        assert unsupported(plan, "torch") == [] and choose_engine(plan) == "torch", change
    assert unsupported(_plan("32-true", offload=True), "torch") == ["optimizer offload"]
    assert unsupported(_plan("32-true", devices=4, tp=2, zero=0), "torch") == [
        "tensor and data parallelism without ZeRO 1, 2 or 3"]


def test_zero1_state_bytes_in_the_torch_engine():
    """Bytes per parameter (weights held, weights gathered, gradients, optimizer incl. the float32 shard, autocast
    copy): bf16-mixed keeps the gathered bf16 weights (2) and FSDP2's float32 accumulated unsharded gradients (4,
    reduce_dtype float32 differs from param_dtype bf16), beside float32 shards (4) and AdamW (8), both over dp."""
    def held(precision, zero):
        s = state_bytes("bfloat16", False, precision, zero)
        return s.weight, s.gathered_bytes, s.grad, s.optimizer_bytes(zero), s.cast_copy
    assert held("bf16-mixed", 1) == (2, 2, 4, 8 + 4, 0)
    assert held("32-true", 1) == (4, 4, 4, 8 + 4, 0)
    assert held("bf16-true", 1) == (2, 2, 2, 4 + 2, 0)



def test_zero1_priced_bytes_for_a_known_parameter_count(small_gpt):
    """Model-state bytes per device for the small GPT (P parameters) on dp 2 under ZeRO 1: weights and gradients
    whole, optimizer states (and the float32 shard) halved; the same gradients ZeRO 2 would halve."""
    graph, model = small_gpt
    p = float(sum(int(np.prod(meta.shape)) for _, meta in graph.params))

    def states(plan: Plan) -> tuple[float, float, float, float]:
        m = estimate(model, dataclasses.replace(plan, blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 4),)),
                                                              ))).memory_breakdown
        return m["parameters_bytes"], m["gradients_bytes"], m["optimizer_bytes"], m["other_bytes"]
    *held, zero1_other = states(_plan("bf16-mixed"))
    assert tuple(held) == (2 * p, 4 * p, 12 * p / 2)
    *held, other = states(_plan("bf16-mixed", zero=2))
    assert tuple(held) == (2 * p, 4 * p / 2, 12 * p / 2) and other > zero1_other   # + FSDP2's buffers (torch_memory)
    assert states(_plan("32-true"))[:3] == (4 * p, 4 * p, 12 * p / 2)



def _fsdp_params(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [p for m in model.modules() if isinstance(m, FSDPModule)
            for group in m._get_fsdp_state()._fsdp_param_groups for p in group.fsdp_params]


def test_zero1_holds_what_is_priced(one_rank):
    """The engine's ZeRO 1 under bf16-mixed, one rank, two micro-batches: after the first backward every weight
    is still gathered (in bf16) and its gradient is held whole in float32, no gradient shard yet (nothing
    reduced); after the last backward the gradients are float32 shards and the gathered weights are freed."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
                                        seq_length=16, vocab_size=64))
    plan = RunPlan(_plan("bf16-mixed", devices=1, dp=1, micro_batch=1, global_batch=2))
    model, _, _ = apply(model, None, plan, torch.device("cpu"))
    params = _fsdp_params(model)
    assert params
    ids = torch.randint(0, 64, (1, 16))
    before = fsdp_micro_batch(model, 1)
    before(False)
    model(ids, ids).backward()
    for p in params:
        assert p.sharded_state == ShardedState.UNSHARDED and p.unsharded_param.dtype == torch.bfloat16
        assert p.unsharded_accumulated_grad.dtype == torch.float32
        assert p.unsharded_accumulated_grad.shape == p.unsharded_param.shape and p.sharded_param.grad is None
    before(True)
    model(ids, ids).backward()
    for p in params:
        assert p.sharded_state == ShardedState.SHARDED and p.unsharded_accumulated_grad is None
        assert p.sharded_param.grad is not None and p.sharded_param.grad.dtype == torch.float32


# ---- real workers: the script's losses -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    return dry_run_plan(GPT_SCRIPT, tmp_path_factory.mktemp("dry"))


def _launch(plan: Plan, tmp_path, devices: int) -> list[float]:
    return launched_with_plan(plan, tmp_path, devices)["losses"]


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_dp2_zero1_with_accumulation_matches_one_process(reference, chosen, tmp_path):
    """dp2, 2 micro-batches of 2 per replica: the first micro-batch's gradients stay unsharded on each rank, the
    second's backward reduce-scatters their sum once; the losses are the script's alone."""
    plan = dataclasses.replace(chosen, devices=2, dp=2, tp=1, pp=1, zero=1, offload=False, micro_batch=2,
                               tp_branches=(), blocks=(BlockPlan("layers.*", ((LayerStrategy("full"), 1),
                                                                              (LayerStrategy("none"), 3))),))
    assert plan.grad_accumulation == 2
    np.testing.assert_allclose(_launch(plan, tmp_path, 2), reference, rtol=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_two_stages_of_two_zero1_replicas_match_one_process(reference, chosen, tmp_path):
    """pp2 x dp2 under ZeRO 1: each stage's relay is FSDP2's root, so the pipeline stage defers the
    reduce-scatter to after the schedule's last backward (2 micro-batches of 2, 1F1B); the tied embedding's
    gradient shards are summed over the two stages; the losses are the script's alone."""
    plan = dataclasses.replace(chosen, devices=4, dp=2, tp=1, pp=2, zero=1, offload=False, micro_batch=2,
                               tp_branches=(), blocks=(BlockPlan("layers.*", ((LayerStrategy("full"), 1),
                                                                              (LayerStrategy("none"), 1))),))
    np.testing.assert_allclose(_launch(plan, tmp_path, 4), reference, rtol=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_tp2_with_zero1_over_dp2_matches_one_process(reference, chosen, tmp_path):
    """A (dp, tp) = 2 x 2 mesh: tensor parallelism inside, FSDP2 ZeRO 1 over the data-parallel axis (2-D DTensors,
    as under ZeRO 2/3), 2 micro-batches of 2 per replica, gradients reduce-scattered once; 4 workers."""
    plan = dataclasses.replace(tp2(chosen, ("attn", "mlp"), micro_batch=2, full_recompute=1), devices=4, dp=2, zero=1)
    assert plan.grad_accumulation == 2
    np.testing.assert_allclose(_launch(plan, tmp_path, 4), reference, rtol=LOSS_RTOL)
