"""Pipeline stages for Hugging Face causal LMs (issue 37): their forward returns an output with ``.loss`` and
``.logits``; the stages are traced returning the loss alone (``runtime.pipeline.trace``), so the last stage computes
the loss the model computes, its label shifting included. The planner offers pipelines for such a model and leaves
them out, with a one-line reason naming what the forward returns, for one whose output holds no loss.

In one process: the cut of a GPT-2 gives the model's loss; what the capture records and the planner offers.
Launched on 2 CPU workers (slow): GPT-2 (tied embeddings summed over the stages), Llama (rotary tables relayed,
1F1B over 4 micro-batches) and Phi-3 (fused projections, interleaved stages) train under ``--pp 2`` to the losses
and final weights of the script run alone."""

import dataclasses
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import EXAMPLES
from workers import LOSS_RTOL, assert_weights_alike, chosen_plan, launched_with_plan, losses_alone

import tensoropt
from launcher import launch
from launcher.devices import detect
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.graph.capture import trace_module
from tensoropt.runtime.pipeline.split import Relay, split_spec, stage_wiring
from tensoropt.runtime.pipeline.trace import trace_pipeline
from tensoropt.search.engines import pipeline_refused
from tensoropt.search.limits import Limits
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

sys.path.insert(0, str(EXAMPLES))
import train_hf  # noqa: E402
from train_nanogpt import GPT  # noqa: E402

HF = str(EXAMPLES / "train_hf.py")
H100 = load_profile("h100-80gb")


def _gpt2() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = train_hf.build("gpt2", 16)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _two_stages(block: str) -> Plan:
    return Plan(devices=2, dp=1, tp=1, pp=2, micro_batch=2, global_batch=2,
                blocks=(BlockPlan(block, ((LayerStrategy("none"), 2),)),))


def test_the_last_stage_of_a_hugging_face_model_computes_its_loss():
    """GPT-2 returns a ``CausalLMOutputWithCrossAttentions``: cut in two, the last stage hands back the loss alone,
    and the stages run one after another give the loss and the gradients of the model run whole."""
    model, inputs = _gpt2()
    output = model(**inputs)
    output.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pipe = trace_pipeline(model, (), inputs, split_spec(model, _two_stages("transformer.h.*")), None)
    assert "forward" not in vars(model)                     # the loss-only forward is gone with the trace
    values = ()
    for stage in range(2):
        wiring = stage_wiring(pipe.split_gm.graph, stage)
        values = Relay(pipe.get_stage_module(stage), wiring)(*values, **{k: inputs[k] for k in wiring.model_inputs})
    assert values.shape == () and wiring.model_inputs == ("labels",)       # HF shifts the labels on the last stage
    torch.testing.assert_close(values, output.loss, rtol=0, atol=0)
    values.backward()
    # the tied embedding and head: a copy on each stage, each with its part of the gradient (the engine sums them)
    tied, got = ("transformer.wte.weight", "lm_head.weight"), {}
    for stage in range(2):
        for name, param in pipe.get_stage_module(stage).named_parameters():
            if param.grad is not None:
                key = tied[0] if name in tied else name
                got[key] = got[key] + param.grad if key in got else param.grad
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_pipelines_are_offered_for_an_output_with_a_loss_and_refused_in_one_line_for_a_tuple():
    """A Hugging Face output: pipelines offered, without tensor parallelism inside the stages (not run yet: its
    reason in one line, from ``launch --pp 2 --tp 2`` too); a tuple: no pipelines, the reason naming it."""
    model, inputs = _gpt2()
    hf = trace_module(model.to("meta"), {k: v.to("meta") for k, v in inputs.items()}, "GPT2",
                      {"global_batch": "8"}, require_loss=True)
    assert hf.meta("output") == "loss" and pipeline_refused(hf) is None
    staged = tensoropt.plan(hf, Cluster(4, 4, H100), global_batch=8, limits=Limits(pipeline_stages=(2,)))
    assert {p.plan.pp for p in staged.points} == {2} and {p.plan.tp for p in staged.points} == {1}
    why = ("no tensor parallelism inside pipeline stages: the forward returns a CausalLMOutputWithCrossAttentions "
           "with .loss Tensor[]: its stages run at tp 1 (tensor parallelism inside its traced stages is not run yet: "
           "GPT-2's Conv1D, Llama's norm casts)")
    with pytest.raises(TensorOptError) as caught:
        launch.plan_for(hf, detect("cpu", 4, None), 4, "fastest", limits=Limits(tensor_parallel=(2,),
                                                                                 pipeline_stages=(2,)))
    assert str(caught.value) == ("no plan the runtime can apply on 4 devices respects --tp 2 --pp 2 (global batch "
                                 f"8): {why}")

    with torch.device("meta"):
        tupled = GPT(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=128, return_logits=True)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    graph = trace_module(tupled, (ids, ids), "GPT")        # planned from Python: the launcher would refuse it
    assert graph.meta("output") == "structured"
    reason = pipeline_refused(graph)
    assert reason == ("the forward returns a tuple (Tensor[2, 64, 64], Tensor[]), no loss for the last stage to "
                      "compute: return the loss (a scalar tensor, or an output with .loss)")
    assert all(p.plan.pp == 1 for p in tensoropt.plan(graph, Cluster(2, 2, H100), global_batch=8).points)
    with pytest.raises(TensorOptError, match="^no plan splits"):
        tensoropt.plan(graph, Cluster(2, 2, H100), global_batch=8, limits=Limits(pipeline_stages=(2,)))


def _trains_in_two_stages(arch: str, tmp_path, change: Callable[[Plan], Plan] = lambda plan: plan) -> Plan:
    """The plan ``launch --pp 2`` chooses for 2 CPU workers, ``change``d, launched: its losses and its final weights
    (``Run.full_state_dict``, gathered from both stages) are the script's alone. Returns the plan run."""
    args = ("--arch", arch)
    alone = losses_alone(HF, tmp_path / "alone.json", *args, "--save-params", tmp_path / "alone.npy")
    chosen, engine = chosen_plan(HF, tmp_path / "dry", 2, *args, options=("--pp", "2"))
    assert (chosen.pp, engine) == (2, "torch"), chosen.summary()
    plan = change(chosen)
    data = launched_with_plan(plan, tmp_path, 2, HF, *args, params=True)
    np.testing.assert_allclose(data["losses"], alone, rtol=LOSS_RTOL, err_msg=plan.summary())
    assert_weights_alike(data["params"], np.load(tmp_path / "alone.npy"), steps=3)
    return plan


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_gpt2_trains_in_the_two_stages_launch_chooses(tmp_path):
    """The launcher's own choice under --pp 2; GPT-2's tied embedding is on both stages, its gradient summed."""
    _trains_in_two_stages("gpt2", tmp_path)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_llama_trains_in_two_stages_over_four_micro_batches(tmp_path):
    """1F1B over 4 micro-batches of 2: the rotary tables made on the first stage are relayed to the second."""
    plan = _trains_in_two_stages("llama", tmp_path, lambda p: dataclasses.replace(p, micro_batch=2))
    assert plan.grad_accumulation == 4


def _interleaved_recomputed(plan: Plan) -> Plan:
    (block,) = plan.blocks
    return dataclasses.replace(plan, virtual_stages=2, micro_batch=4,
                               blocks=(BlockPlan(block.block, ((LayerStrategy("full"), 2),)),))


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_phi3_trains_in_interleaved_stages(tmp_path):
    """Two virtual stages a device (one layer each), every layer recomputed: the last of the four stages is the head
    and loss of the fused-projection model."""
    _trains_in_two_stages("phi3", tmp_path, _interleaved_recomputed)
