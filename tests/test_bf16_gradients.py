"""bf16 gradients (issue 33 item 4): a plan property (``grad_dtype``) of bf16-mixed plans, priced as FSDP2 holds and
communicates it, searched where the torch engine runs it (ZeRO 1-3), and run with ``reduce_dtype=bfloat16``. The
2-worker launch against the script alone is in tests/test_precision.py, its memory against the simulation in
tests/test_memory_check.py (they share one launch)."""

import dataclasses

import numpy as np
import pytest
import torch

from tensoropt.api import capture
from tensoropt.cost.comm import all_reduce_s
from tensoropt.cost.model import ModelCost, estimate, state_bytes
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.graph.fold import fold
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.engines.precision import fsdp_kwargs
from tensoropt.runtime.engines.torch_engine import apply
from tensoropt.runtime.parallel.data_parallel import fsdp_micro_batch
from tensoropt.search.engines import choose_engine, unsupported
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan
from tensoropt.space.run_plan import RunPlan

BLOCKS = (BlockPlan("layers.*", ((LayerStrategy("none"), 4),)),)


def _plan(zero: int = 1, grad_dtype: str = "bfloat16", **change) -> Plan:
    """SMALL_GPT's 4 layers on 2 devices, 2 micro-batches per replica, bf16-mixed on the torch engine."""
    base = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=8, zero=zero, blocks=BLOCKS,
                master_weights=False, precision="bf16-mixed", engine="torch", grad_dtype=grad_dtype)
    return dataclasses.replace(base, **change)


def test_state_bytes_with_bf16_gradients():
    """Bytes per parameter (weights held, gathered, gradients held, reduced, optimizer incl. the float32 shard):
    ZeRO 1 accumulates whole bf16 gradients (2, not FSDP2's float32 4); ZeRO 2-3 keep float32 gradient shards, as
    with float32 reductions, and reduce 2 bytes instead of 4; DeepSpeed's bf16 mode and the other precisions are
    unchanged by it."""
    def held(zero, grad="bfloat16", master=False, precision="bf16-mixed"):
        s = state_bytes("bfloat16", master, precision, zero, grad)
        return s.weight, s.gathered_bytes, s.grad, s.reduced_bytes, s.optimizer_bytes(zero)
    assert held(1) == (2, 2, 2, 2, 8 + 4)
    assert held(1, grad="") == (2, 2, 4, 4, 8 + 4)
    assert held(2) == (2, 2, 4, 2, 8 + 4)
    assert held(3) == (4, 2, 4, 2, 8)
    assert held(1, master=True) == held(1, grad="", master=True) == (2, 2, 2, 2, 12)    # DeepSpeed bf16 mode
    assert held(0, grad="") == (4, 4, 4, 4, 8)


def test_plan_round_trips_and_says_its_gradients():
    plan = _plan()
    assert Plan.from_json(plan.to_json()) == plan and plan.to_json()["grad_dtype"] == "bfloat16"
    assert "zero1 grad:bf16" in plan.summary()
    assert "grad_dtype" not in _plan(grad_dtype="").to_json()                         # older files are unchanged
    run_plan = RunPlan(plan, engine="torch", device="cpu")
    assert RunPlan.from_json(run_plan.to_json()) == run_plan
    with pytest.raises(ValueError, match='"grad_dtype" must be \'bfloat16\''):
        Plan.from_json(plan.to_json() | {"grad_dtype": "float16"})
    with pytest.raises(ValueError, match='"grad_dtype" \'bfloat16\' needs "precision" "bf16-mixed"'):
        Plan.from_json(plan.to_json() | {"precision": "bf16-true"})


def test_the_engines_run_bf16_gradients_where_they_hold_them():
    """FSDP2 (ZeRO 1-3) reduces in bf16 when asked; DDP keeps gradients in the float32 weights' dtype; DeepSpeed's
    bf16 mode holds bf16 gradients anyway, so launch gives a ZeRO 0 plan with bf16 gradients to DeepSpeed."""
    for zero in (1, 2, 3):
        assert unsupported(_plan(zero), "torch") == [] and choose_engine(_plan(zero)) == "torch"
    assert unsupported(_plan(0), "torch") == ["bf16 gradients without ZeRO 1, 2 or 3"]
    assert choose_engine(_plan(0)) == "deepspeed"
    policy = fsdp_kwargs("bf16-mixed", "bfloat16")["mp_policy"]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert fsdp_kwargs("bf16-mixed")["mp_policy"].reduce_dtype == torch.float32



def test_priced_states_and_communication(small_gpt):
    """For the small GPT's P parameters on dp 2, 2 micro-batches: ZeRO 1 holds 2 + 2 + 12/2 bytes per parameter
    with bf16 gradients (4 + 12/dp: DESIGN's reference footprint) against 2 + 4 + 12/2 with float32 ones, and its
    step's all-reduce volume is the bf16 gradients' (half); ZeRO 3 holds the same states either way."""
    graph, model = small_gpt
    p = float(sum(int(np.prod(meta.shape)) for _, meta in graph.params))
    lean, full = (estimate(model, _plan(1, grad)) for grad in ("bfloat16", ""))
    for e, grad in ((lean, 2), (full, 4)):
        m = e.memory_breakdown
        assert (m["parameters_bytes"], m["gradients_bytes"], m["optimizer_bytes"]) == (2 * p, grad * p, 12 * p / 2)
        assert e.time_breakdown["data_parallel_comm_s"] == all_reduce_s(np.array([grad * p]), 2, 1, model.cluster)[0]
    assert full.peak_memory_bytes - lean.peak_memory_bytes >= 2 * p
    three = [estimate(model, _plan(3, grad)).memory_breakdown for grad in ("bfloat16", "")]
    assert all(three[0][k] == three[1][k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"))



def _gradients_held_bytes(model: torch.nn.Module) -> tuple[int, set]:
    """Bytes and dtypes of the gradients FSDP2 holds for ``model``: unsharded (accumulated, or autograd's) and
    sharded."""
    from torch.distributed.fsdp import FSDPModule
    tensors = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    tensors += [fp.unsharded_accumulated_grad, getattr(unsharded, "grad", None), fp.sharded_param.grad]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors), {t.dtype for t in tensors}


@pytest.mark.parametrize("grad_dtype, dtype", [("bfloat16", torch.bfloat16), ("", torch.float32)])
def test_a_real_rank_holds_the_priced_gradient_bytes(one_rank, grad_dtype, dtype):
    """ZeRO 1 in bf16-mixed, one real rank (gloo), two micro-batches: after the first backward FSDP2 holds each
    gradient whole, in bf16 with bf16 gradients (autograd's own, accumulated in place by the second backward) and in
    float32 without (``unsharded_accumulated_grad``): exactly the gradient bytes the cost model prices for the plan
    (the model captured as it is, its parameters counted by the graph); after the last backward, float32 shards."""
    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                            vocab_size=64)
    ids = torch.randint(0, 64, (1, 16))
    graph = capture(DecoderLM(cfg), (ids, ids), seq_len=16).graph
    plan = Plan(devices=1, dp=1, tp=1, pp=1, micro_batch=1, global_batch=2, zero=1, master_weights=False,
                precision="bf16-mixed", engine="torch", grad_dtype=grad_dtype,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 2),)),))
    priced = estimate(ModelCost(graph, fold(graph), Cluster(1, 1, load_profile("h100-80gb"))), plan)
    model, _, _ = apply(DecoderLM(cfg), None, RunPlan(plan), torch.device("cpu"))
    before = fsdp_micro_batch(model, 1)
    before(False)
    model(ids, ids).backward()
    held, dtypes = _gradients_held_bytes(model)
    assert dtypes == {dtype} and held == priced.memory_breakdown["gradients_bytes"] > 0
    before(True)
    model(ids, ids).backward()
    held, dtypes = _gradients_held_bytes(model)
    assert dtypes == {torch.float32} and held == 4 * graph.num_parameters        # float32 shards, dp 1
