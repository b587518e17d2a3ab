"""The pipeline's message buffers in the cost model (``tensoropt.cost.pipeline_memory``): torch's stages allocate
one receive buffer per micro-batch, so a stage's memory grows with the step's micro-batches even where 1F1B keeps
no more of them in flight."""

import dataclasses

import pytest

import tensoropt
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.pipeline_memory import held_first_bytes, held_last_bytes, p2p_buffer_bytes
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

GPT = {"family": "gpt", "hidden_size": 64, "num_layers": 8, "num_attention_heads": 4,
       "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 256}


def test_buffer_sets_and_held_sends_per_device():
    """Device 0 of 1F1B: stage 0's gradient buffers (one set), its in-flight outputs (min(m, p)); the last device
    one pending gradient send (m of them under GPipe, m < p); with v virtual stages 2v - 1 sets of each; none
    unpiped."""
    assert p2p_buffer_bytes(2, 1, 4, 2, 100) == 800
    assert p2p_buffer_bytes(4, 2, 8, 1, 100) == 3 * 8 * 100
    assert p2p_buffer_bytes(1, 1, 4, 2, 100) == 0
    assert held_first_bytes(4, 1, 8, 2, 100) == 4 * 2 * 100 and held_first_bytes(4, 1, 2, 2, 100) == 2 * 2 * 100
    assert held_last_bytes(4, 1, 8, 2, 100) == 2 * 100 and held_last_bytes(4, 1, 2, 2, 100) == 2 * 2 * 100
    assert held_first_bytes(2, 2, 4, 1, 100) == held_last_bytes(2, 2, 4, 1, 100) == 3 * 4 * 100
    assert held_first_bytes(1, 1, 4, 1, 100) == held_last_bytes(1, 1, 4, 1, 100) == 0


@pytest.mark.parametrize("virtual", [1, 2])
def test_more_micro_batches_cost_their_messages_and_nothing_else(write_json, virtual):
    """pp2, 4 copies a device: 4 and then 8 micro-batches of 2 keep the same activations in flight (min(m, p)), so
    the activations the estimate prices grow by exactly the new micro-batches' buffers, (2v - 1) sets of 2 samples
    of the stream a copy hands the next (hidden 64 x 64 positions in the capture's bf16: 8 KiB a sample), and with
    interleaving as many sends held to the step's end."""
    graph = tensoropt.capture(write_json("m.json", GPT)).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb")))
    ((block, cost),) = model.blocks
    assert cost.space.carried_bytes == 64 * 64 * 2
    plan = Plan(devices=2, dp=1, tp=1, pp=2, micro_batch=2, global_batch=8, virtual_stages=virtual, dtype="float32",
                blocks=(BlockPlan(block.name, ((LayerStrategy("none"), 4),)),))
    activations = [estimate(model, dataclasses.replace(plan, global_batch=b)).memory_breakdown["activations_bytes"]
                   for b in (8, 16)]
    sets = (2 * virtual - 1) * (2 if virtual > 1 else 1)
    assert activations[1] - activations[0] == sets * 4 * 2 * 64 * 64 * 2
