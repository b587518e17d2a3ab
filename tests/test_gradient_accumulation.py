"""The micro-batches' gradients summed on the device (``cost.accumulation``, issue 35): the passes the torch
engine's data parallelism makes, counted below autograd under torchrun, are the bytes the cost model prices, and
an estimate carries their time, except for Megatron-LM's runtime, whose products accumulate themselves."""


import pytest
from conftest import SMALL_GPT
from workers import probe_under_torchrun

from tensoropt.cost.accumulation import accumulation_bytes
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.runtimes import Runtime
from tensoropt.cost.states import state_bytes
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

MICRO_BATCHES = 3      # tests/accumulation_probe.py's


def _widths(precision: str, zero: int, grad_dtype: str = "") -> tuple[int, int]:
    """(held, fresh) gradient widths the cost model prices the torch engine's plan with (``cost.states``)."""
    dtype = "float32" if precision == "32-true" else "bfloat16"
    state = state_bytes(dtype, False, precision, zero, grad_dtype)
    return state.grad, state.gathered_bytes


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_the_runtimes_gradient_sums_move_the_bytes_priced(tmp_path):
    """Per case, a second step's passes over parameter-shaped tensors: DDP adds every later micro-batch's gradient
    in place; FSDP2's ZeRO 1 over bf16 weights casts the first into its float32 accumulator and adds the later ones
    into it (bf16 gradients: in place in bf16); ZeRO 3 adds each reduce-scattered shard into the rank's."""
    probe = probe_under_torchrun("accumulation_probe.py", tmp_path)
    cases = {"zero0 32-true": (0, "32-true", ""), "zero0 bf16-mixed": (0, "bf16-mixed", ""),
             "zero1 bf16-mixed": (1, "bf16-mixed", ""), "zero1 bf16-mixed bfloat16": (1, "bf16-mixed", "bfloat16"),
             "zero3 bf16-mixed": (3, "bf16-mixed", "")}
    assert set(probe) == set(cases)
    for name, (zero, precision, grad_dtype) in cases.items():
        seen = probe[name]["micro_batches"]
        if name == "zero0 bf16-mixed":
            # autocast's backward casts each cast weight's gradient to float32 on every micro-batch alike: an op of
            # the graph (priced with the ops), not a sum
            casts = [mb.pop("_to_copy torch.bfloat16 -> torch.float32") for mb in seen]
            assert casts[0][0] > 0 and all(c == casts[0] for c in casts), casts
        measured = sum(nbytes for mb in seen for _, nbytes in mb.values())
        held, fresh = _widths(precision, zero, grad_dtype)
        priced = accumulation_bytes(probe[name]["elements"], MICRO_BATCHES, zero, 2, held, fresh)
        assert measured == priced, (name, seen, held, fresh)
        assert seen[0] == {} or zero == 1 and not grad_dtype      # the first micro-batch sums nothing, but a cast
    # one pass a parameter a later micro-batch: 29 parameter tensors
    assert probe["zero1 bf16-mixed"]["micro_batches"][1] == {"add_ torch.float32 += torch.bfloat16": [29, 606080]}


@pytest.fixture(scope="module")
def model(small_gpt):
    return small_gpt[1]


def _plan(zero: int, micro_batches: int) -> Plan:
    return Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=8 // micro_batches, global_batch=16, zero=zero,
                master_weights=False, precision="bf16-mixed",
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), SMALL_GPT["num_layers"]),)),))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_an_estimate_pays_the_sums_of_its_later_micro_batches_at_the_copy_rate(model, zero):
    profile = model.cluster.profile
    one, four = estimate(model, _plan(zero, 1)), estimate(model, _plan(zero, 4))
    assert one.time_breakdown["gradient_accumulation_s"] == 0.0
    held, fresh = _widths("bf16-mixed", zero)
    params = four.memory_breakdown["parameters_bytes"] / (state_bytes("bfloat16", False, "bf16-mixed", zero).weight
                                                          / (2 if zero == 3 else 1))
    expected = accumulation_bytes(params, 4, zero, 2, held, fresh) / profile.copy_bytes_per_s
    assert four.time_breakdown["gradient_accumulation_s"] == pytest.approx(expected, rel=1e-9)
    assert expected > 0
    # Megatron-LM's weight-gradient products add into its float32 buffer: the same plan without the pass
    megatron = ModelCost(model.graph, model.folded, model.cluster, runtime=Runtime.MEGATRON)
    fused = estimate(megatron, _plan(zero, 4))
    assert fused.time_breakdown["gradient_accumulation_s"] == 0.0
    assert four.iteration_time_s - fused.iteration_time_s == pytest.approx(expected, rel=1e-9)


def test_a_whole_gradient_widened_to_float32_costs_more_a_micro_batch_than_one_summed_in_its_own_dtype():
    """Per parameter and later micro-batch: 2 + 4 + 4 bytes (FSDP2's float32 sum of bf16 gradients) against
    3 x 2 (bf16 in place) and 3 x 4 (float32 in place); the widening cast of the first micro-batch, 2 + 4."""
    assert accumulation_bytes(1, 3, 1, 2, 4, 2) == 2 * 10 + 6
    assert accumulation_bytes(1, 3, 1, 2, 2, 2) == 2 * 6
    assert accumulation_bytes(1, 3, 0, 2, 4, 4) == 2 * 12
    assert accumulation_bytes(8, 3, 3, 8, 4, 2) == 2 * 12        # a shard of 8 / 8 elements
    assert accumulation_bytes(1, 1, 1, 2, 4, 2) == 0.0
