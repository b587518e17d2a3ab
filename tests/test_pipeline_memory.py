"""A pipeline stage's memory in the cost model (``tensoropt.cost.pipeline_memory``): the engine's executor holds the
messages in flight, never one per micro-batch of the step, so more micro-batches cost no memory once the schedule
keeps as many in flight as it can; FSDP2 inside stages, copy backwards, the embedding's gradient."""

import dataclasses

import pytest

import tensoropt
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.pipeline_memory import (
    copy_backward_bytes,
    fsdp_stage_bytes,
    gradients_divisor,
    message_bytes,
    table_gradient_elements,
)
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

GPT = {"family": "gpt", "hidden_size": 64, "num_layers": 8, "num_attention_heads": 4,
       "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 256}
LLAMA = {"family": "llama", "hidden_size": 64, "num_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "ffn_hidden_size": 128, "seq_length": 32, "vocab_size": 128}


def test_messages_held_per_device():
    """1F1B: the last device's next activation, received while it runs a backward, whatever the micro-batches;
    interleaved: the last device's early gradients too (at least 2 once m > p, floor(p / 3) from p = 6), device
    0's from p = 4; each of micro_batch x the carried bytes; none unpiped."""
    assert message_bytes(4, 1, 8, 2, 100) == (0, 2 * 100) and message_bytes(4, 1, 2, 2, 100) == (0, 2 * 100)
    assert message_bytes(4, 1, 1, 2, 100) == (0, 0)
    assert message_bytes(4, 2, 8, 2, 100) == (2 * 100, 3 * 2 * 100)
    assert message_bytes(8, 2, 16, 1, 100) == (2 * 100, 3 * 100)
    assert message_bytes(1, 1, 4, 1, 100) == (0, 0)


@pytest.mark.parametrize("virtual", [1, 2])
def test_more_micro_batches_cost_no_memory(write_json, virtual):
    """pp2, 4 copies a device: 4 and then 8 micro-batches of 2 keep the same activations in flight (min(m, p), or
    interleaved's warm-up), and the executor holds no buffer per micro-batch: the same activations (torch's own
    stages held (2v - 1) sets of m receive buffers, and with interleaving every send to the step's end)."""
    graph = tensoropt.capture(write_json("m.json", GPT)).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb")))
    ((block, cost),) = model.blocks
    assert cost.space.carried_bytes == 64 * 64 * 2
    plan = Plan(devices=2, dp=1, tp=1, pp=2, micro_batch=2, global_batch=8, virtual_stages=virtual, dtype="float32",
                blocks=(BlockPlan(block.name, ((LayerStrategy("none"), 4),)),))
    activations = [estimate(model, dataclasses.replace(plan, global_batch=b)).memory_breakdown["activations_bytes"]
                   for b in (8, 16, 64)]
    assert activations[0] == activations[1] == activations[2]


def test_zero2_and_zero3_stages_shard_their_gradients():
    """The torch engine's ZeRO 2/3 stages reduce-scatter every micro-batch (the relay is no FSDP2 root); ZeRO 0/1
    stages accumulate whole gradients until the last backward."""
    assert [int(gradients_divisor(2, zero, 4)) for zero in (0, 1, 2, 3)] == [1, 1, 4, 4]
    assert [int(gradients_divisor(1, zero, 4)) for zero in (0, 1, 2, 3)] == [1, 1, 4, 4]


def test_fsdp_stage_terms():
    """ZeRO 3: the root unit's loose parameters gathered, one unit prefetched beside the loss's backward, and in a
    copy's backward its unit, the next one and two units' gradients; ZeRO 2 only the two units' gradients; bf16
    (2 bytes a parameter gathered and reduced), 10 parameters a unit, 7 loose."""
    held, at_loss, in_copy = fsdp_stage_bytes([1, 2, 3], 2, 2, 10, 7)
    assert list(held) == [0, 0, 14] and list(at_loss) == [0, 0, 20] and list(in_copy) == [0, 40, 80]


def test_stage_gradients_priced_as_the_engine_reduces(write_json):
    """An estimate of a pp2 plan: ZeRO 3's gradients are a 1/dp shard of ZeRO 1's whole ones."""
    graph = tensoropt.capture(write_json("m.json", GPT)).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(8, 8, load_profile("h100-80gb")))
    ((block, _),) = model.blocks
    grads = {zero: estimate(model, Plan(devices=8, dp=4, tp=1, pp=2, micro_batch=1, global_batch=16, zero=zero,
                                        blocks=(BlockPlan(block.name, ((LayerStrategy("full"), 4),)),))
                            ).memory_breakdown["gradients_bytes"] for zero in (1, 3)}
    assert grads[3] * 4 == pytest.approx(grads[1])


def test_copy_backward_gradients_on_a_stage(write_json):
    """The largest op backward of a Llama copy (hidden 64, ffn 128, 32 positions; the capture's linears in bf16):
    the gated MLP's product makes two 32 x 128 bf16 gradients from one (24 KiB a sample); with accumulated
    gradients the up/gate projection's backward is larger: its output's gradient (8 KiB), its input's (4 KiB)
    and the 128 x 64 weight's fresh gradient (grad_bytes a parameter). Tensor parallelism over the MLP halves
    those, leaving a float32 norm op's 16 KiB + 128 B the largest. An estimate of a pp2 ZeRO 0/1 plan without
    recomputation carries exactly the fresh version (float32 gradients) in its working set."""
    graph = tensoropt.capture(write_json("m.json", LLAMA)).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(4, 4, load_profile("h100-80gb")))
    product, projection, weight = 3 * 32 * 128 * 2, 32 * 128 * 2 + 32 * 64 * 2, 128 * 64
    assert copy_backward_bytes(model, 1, (), 1, 2) == (product, projection + 2 * weight)
    assert copy_backward_bytes(model, 1, (), 2, 4) == (2 * product, 2 * projection + 4 * weight)
    assert copy_backward_bytes(model, 2, ("attn", "mlp"), 1, 2) == (2 * 32 * 64 * 4 + 32 * 4,) * 2
    ((block, _),) = model.blocks
    fixed = model.cluster.profile.runtime_overhead_bytes + model.buffer_bytes

    def working(zero: int, pp: int) -> float:
        plan = Plan(devices=2 * pp, dp=2, tp=1, pp=pp, micro_batch=1, global_batch=8, zero=zero, dtype="float32",
                    master_weights=False, precision="32-true",
                    blocks=(BlockPlan(block.name, ((LayerStrategy("none"), 4 // pp),)),))
        return estimate(model, plan).memory_breakdown["other_bytes"] - fixed
    assert working(0, 2) == working(1, 2) == projection + 4 * weight


def test_the_first_stage_holds_the_whole_tables_gradient_under_the_vocabulary_split(write_json):
    """DTensor's embedding backward makes the whole table's gradient on every tensor-parallel rank (Partial, then
    reduced to the rank's vocabulary shard): the first stage's embedding backward holds vocab x hidden elements in
    the weights' dtype. Without the split, or without stages, nothing beyond the states."""
    graph = tensoropt.capture(write_json("m.json", LLAMA)).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(4, 4, load_profile("h100-80gb")))
    first, _ = model.loose(2, 1, 2)
    table = LLAMA["vocab_size"] * LLAMA["hidden_size"]
    assert first.table_grad_elements == table
    assert table_gradient_elements(2, True, table) == table
    assert table_gradient_elements(2, False, table) == 0 == table_gradient_elements(1, True, table)
