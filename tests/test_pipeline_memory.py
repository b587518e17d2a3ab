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
    recomputation carries exactly the fresh version (float32 gradients) in its working set (ZeRO 0: DDP)."""
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
    assert working(0, 2) == projection + 4 * weight
    # a ZeRO 1 stage (FSDP2) also reduces its accumulated gradients in its last backward, a moment of its own with
    # the reduce-scatter's buffers (``cost.memory.stage_reduction_bytes``; simulated in tests/test_memory_bound.py)
    assert working(1, 2) > working(0, 2)


def test_the_vocabulary_split_embedding_makes_its_rows_gradient_only():
    """Megatron-LM's vocabulary-parallel embedding (``runtime.parallel.vocab_parallel.VocabEmbedding``): a tp rank looks
    up its own rows, so the embedding's backward makes a gradient of V/tp rows (torch's RowwiseParallel made the whole
    table's, V rows, on every rank: Nemotron-4 340B's 8.8 GiB in bf16). One rank of two on a fake process group:
    ``embedding_dense_backward`` is asked for 8 of the table's 16 rows, and the weight's gradient is the rank's
    shard."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from tensoropt.runtime.parallel.vocab_parallel import VocabEmbedding

    class Rows(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.embedding_dense_backward.default:
                self.seen.append(args[2])               # num_weights
            return func(*args, **(kwargs or {}))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        embedding = torch.nn.Embedding(16, 4)
        parallelize_module(embedding, init_device_mesh("cpu", (2,)), VocabEmbedding())
        ids = torch.tensor([[0, 3, 9, 15]])
        with Rows():
            embedding(ids).sum().backward()
        assert Rows.seen == [8]
        assert embedding.weight.grad.to_local().shape == (8, 4)
        # rank 0 holds rows 0-7: the tokens 0 and 3 get its rows' gradient, 9 and 15 nothing here
        assert embedding.weight.grad.to_local().sum(1).tolist() == [4.0, 0, 0, 4.0, 0, 0, 0, 0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family, attention", [("gpt", None), ("llama", "flash")])
def test_a_stage_receives_the_side_inputs_its_copies_read(write_json, family, attention):
    """What the copies read from outside their stream, every stage but the first receives per micro-batch: a GPT's
    causal-mask buffer (eager attention reads it), a Llama's rotary tables (flash attention reads no mask). Priced
    once per received chunk in flight (``pipeline_memory.relayed_in_flight``): an interleaved plan's device 0 holds
    F - (its stage-0 chunks) of them beyond what it held without."""
    cfg = (GPT if family == "gpt" else LLAMA) | ({"attention": attention} if attention else {})
    graph = tensoropt.capture(write_json("m.json", cfg)).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(4, 4, load_profile("h100-80gb")))
    read = {"gpt": ("causal_mask",), "llama": ("rope_cos", "rope_sin")}[family]
    assert model.relayed_fixed_bytes == sum(m.nbytes for name, m in graph.buffers if name in read) > 0
    assert model.relayed_bytes == 0
    ((block, _),) = model.blocks
    copies = block.repeats // 2
    plan = Plan(devices=4, dp=2, tp=1, pp=2, micro_batch=1, global_batch=8, virtual_stages=2, dtype="float32",
                blocks=(BlockPlan(block.name, ((LayerStrategy("none"), copies),)),))
    priced = estimate(model, plan).memory_breakdown["activations_bytes"]
    model.relayed_fixed_bytes, kept = 0.0, model.relayed_fixed_bytes
    # p 2, v 2, 4 micro-batches: device 0 forwards 5 chunks before its first backward, stage 0 of micro-batches 0, 1
    # and 4 and stage 2 (received) of 0 and 1
    assert priced - estimate(model, plan).memory_breakdown["activations_bytes"] == pytest.approx(2 * kept, rel=1e-12)
