"""What the torch engine runs with pipeline stages, as the planner's table says it: single process, no workers."""

import dataclasses

import pytest

from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.memory.recompute import recomputed_modules
from tensoropt.search.engines import choose_engine, unsupported
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan


def _plan(**change) -> Plan:
    base = Plan(devices=4, dp=2, tp=1, pp=2, micro_batch=2, global_batch=8, zero=0, offload=False,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("full"), 1), (LayerStrategy("none"), 1))),))
    return dataclasses.replace(base, **change)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_pipelines_with_data_parallelism_run_on_torch(zero):
    assert choose_engine(_plan(zero=zero)) == "torch" and not unsupported(_plan(zero=zero), "torch")


def test_pipelines_with_tensor_parallelism_run_on_torch_with_data_parallelism_sharded():
    assert choose_engine(_plan(devices=8, tp=2, zero=3, virtual_stages=2)) == "torch"
    assert choose_engine(_plan(devices=4, dp=1, tp=2, zero=0)) == "torch"
    assert unsupported(_plan(devices=8, tp=2, zero=0), "torch") == [
        "tensor and data parallelism without ZeRO 1, 2 or 3"]


def test_recomputed_copies_follow_each_device_s_stages():
    """4 layers, pp2 x 2 virtual stages: device 0 holds layers 0 and 2, device 1 layers 1 and 3; each device
    recomputes its first copy (layer 0 on device 0, layer 1 on device 1)."""
    model = DecoderLM(TransformerConfig(hidden_size=8, num_layers=4, num_attention_heads=2, ffn_hidden_size=16,
                                        seq_length=4, vocab_size=16))
    assert recomputed_modules(model, _plan(virtual_stages=1)) == ["layers.0", "layers.2"]
    assert recomputed_modules(model, _plan(virtual_stages=2)) == ["layers.0", "layers.1"]


def test_sequence_parallelism_inside_pipeline_stages_is_run_with_and_without_virtual_stages():
    """Each stage's SP copies are entered and left with the whole sequence; with interleaved virtual stages each of
    a device's stages does so for its own share of the device's copies, as cost.model.device_chain_sums prices."""
    for virtual in (1, 2):
        plan = _plan(devices=8, tp=2, zero=3, virtual_stages=virtual,
                     blocks=(BlockPlan("layers.*", ((LayerStrategy("none", True), 2),)),))
        assert not unsupported(plan, "torch") and choose_engine(plan) == "torch"
