"""Pipeline stages in the torch engine: real torchrun workers over gloo (one stage each, two interleaved stages
each, or stages of two data-parallel replicas), compared with the same script run alone; and the cut itself
(which stage reads, relays and sends what) in one process."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import LAUNCH_CWD, REPO
from workers import ENV, GPT_SCRIPT, LOSS_RTOL, dry_run_plan, launched_with_plan, losses_alone, tensoropt_cli

from tensoropt.errors import TensorOptError
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.pipeline.split import Relay, message_gradients, split_spec, stage_messages, stage_wiring
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

# the tests that start workers are slow and share the "multiprocess" xdist group; the two in-process ones are neither
SCRIPT = GPT_SCRIPT
STAGES = str(REPO / "tests" / "train_stages.py")


@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    """The plan a dry run chooses for 2 CPU workers: the starting point the pipeline plans are made from."""
    return dry_run_plan(SCRIPT, tmp_path_factory.mktemp("dry"))


def _two_stages(plan: Plan, micro_batch: int, full_recompute: int) -> Plan:
    """Two stages of 2 layers each; each stage recomputes its first ``full_recompute`` layers."""
    strategies = tuple((LayerStrategy(r), n) for r, n in (("full", full_recompute), ("none", 2 - full_recompute)) if n)
    return dataclasses.replace(plan, dp=1, tp=1, pp=2, zero=0, offload=False, micro_batch=micro_batch,
                               blocks=(BlockPlan("layers.*", strategies),))


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("micro_batch, full_recompute", [
    (2, 0),     # 4 micro-batches: 1F1B, no recomputation
    (8, 2),     # 1 micro-batch (fewer than stages): GPipe, every layer recomputed
])
def test_two_stages_match_one_process(reference, chosen, tmp_path, micro_batch, full_recompute):
    """Also with the script's --local-data (its rows only, the loss read back only when logged): the pipeline's step
    returns the loss on the device like the others."""
    data = launched_with_plan(_two_stages(chosen, micro_batch, full_recompute), tmp_path, 2, SCRIPT,
                              *(("--local-data", "--log-every", "2") if micro_batch == 2 else ()))
    # the same sums in another order (micro-batch means averaged, gradients scaled after accumulation)
    np.testing.assert_allclose(data["losses"], reference, rtol=LOSS_RTOL)


def _launch(plan: Plan, tmp_path, devices: int, script: str = SCRIPT) -> dict:
    return launched_with_plan(plan, tmp_path, devices, script)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("zero", [0, 3])
def test_two_stages_of_two_replicas_match_one_process(reference, chosen, tmp_path, zero):
    """pp2 x dp2 on a ("pp", "dp") mesh: each pipeline trains its half of the batch (2 micro-batches of 2,
    1F1B), DDP (ZeRO 0) or FSDP2 (ZeRO 3) averages the stages' gradients over the replicas, the tied
    embedding's gradient is summed over the two stages of each pipeline; the losses are the script's alone."""
    plan = dataclasses.replace(_two_stages(chosen, 2, 1), devices=4, dp=2, zero=zero)
    data = _launch(plan, tmp_path, 4)
    np.testing.assert_allclose(data["losses"], reference, rtol=LOSS_RTOL)


def _small_gpt() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
                                       seq_length=16, vocab_size=64))


def _plan(pp: int, copies: int) -> Plan:
    return Plan(devices=pp, dp=1, tp=1, pp=pp, micro_batch=1, global_batch=pp,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), copies),)),))


def test_four_relayed_stages_compute_the_model():
    """Every stage reads its own model inputs (the last one the labels) and relays what later stages use
    (the attention mask, made by stage 0): run one after another, the stages give the model's loss."""
    from torch.distributed.pipelining import pipeline
    model = _small_gpt()
    inputs = {"input_ids": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}
    expected = model(**inputs)
    pipe = pipeline(model, mb_args=(), mb_kwargs=inputs, split_spec=split_spec(model, _plan(4, 1)))
    wirings = [stage_wiring(pipe.split_gm.graph, s) for s in range(4)]
    assert wirings[0].model_inputs == ("input_ids",) and wirings[-1].model_inputs == ("labels",)
    assert wirings[0].receives == () and wirings[-1].sends is None
    assert all(len(w.sends) == 2 for w in wirings[:-1])            # the stream and the relayed mask
    values = ()
    for s, wiring in enumerate(wirings):
        values = Relay(pipe.get_stage_module(s), wiring)(*values, **{k: inputs[k] for k in wiring.model_inputs})
    torch.testing.assert_close(values, expected)


def test_only_messages_a_gradient_flows_through_require_one():
    """A rope model's first stage makes the rotary tables and the mask from buffers and positions, and relays
    them: a later stage receives them without requiring a gradient (else its products would save their partners
    and send gradients back for nothing); the stream requires one. Run so, the stages give the model's gradients."""
    from torch.distributed.pipelining import pipeline
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
                                       seq_length=16, vocab_size=64, position="rope", norm="rmsnorm",
                                       tie_embeddings=False))
    inputs = {"input_ids": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}
    pipe = pipeline(model, mb_args=(), mb_kwargs=inputs, split_spec=split_spec(model, _plan(2, 2)))
    wiring = stage_wiring(pipe.split_gm.graph, 1)
    received, _ = stage_messages(pipe, 1)
    needs = message_gradients(pipe)
    assert len(received) >= 3 and [needs[name] for name in wiring.receives] == [m.requires_grad for m in received]
    streams = [m for m in received if m.requires_grad]
    assert len(streams) == 1 and streams[0].shape == (2, 16, 32)      # the hidden stream only
    assert any(m.is_floating_point() and not m.requires_grad for m in received)   # cos / sin
    # as the schedule runs them: stage 1 on leaves made from the messages, the stream's gradient sent back to
    # stage 0 only; the model's parameters get the gradients of the model run whole
    model(**inputs).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    wirings = [stage_wiring(pipe.split_gm.graph, s) for s in range(2)]
    stages = [Relay(pipe.get_stage_module(s), w) for s, w in enumerate(wirings)]
    sent = stages[0](input_ids=inputs["input_ids"])
    leaves = [m.detach().requires_grad_(needs[name]) for m, name in zip(sent, wirings[1].receives)]
    stages[1](*leaves, labels=inputs["labels"]).backward()
    torch.autograd.backward([m for m, leaf in zip(sent, leaves) if leaf.requires_grad],
                            [leaf.grad for leaf in leaves if leaf.requires_grad])
    got = {n: p.grad for s in range(2) for n, p in pipe.get_stage_module(s).named_parameters()}
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name])


class _Residual(torch.nn.Module):
    """A stage whose output is a residual sum (its backward reads no output), a view of the whole of one (as a
    sequence-parallel share handed on: ``DTensor.to_local()``'s view), a partial view of one, or an ``exp`` (whose
    backward reads its output)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear, self.kind = torch.nn.Linear(8, 8), kind

    def forward(self, x):
        y = self.linear(x)
        if self.kind == "exp":
            return (torch.exp(y),)
        y = y + x
        return ({"view": y.view_as(y), "partial": y[:, :4]}.get(self.kind, y),)


@pytest.mark.parametrize("kind, freed", [("sum", True), ("view", True), ("partial", False), ("exp", False)])
def test_a_sent_output_keeps_no_storage_and_its_backward_is_exact(kind, freed):
    """After its send a stage output's storage is freed where no backward reads it (a residual sum, or a view of the
    whole of one: its base goes too), kept where a backward does (``exp``) or where it views part of a tensor; and
    either way the backward from the received gradient gives the input's and the weights' gradients of the stage run
    plainly."""
    from tensoropt.runtime.pipeline.executor import StageRunner
    torch.manual_seed(0)
    module, x = _Residual(kind), torch.randn(4, 8)
    width = 4 if kind == "partial" else 8
    grad = torch.randn(4, width)
    reference = x.clone().requires_grad_()
    module(reference)[0].backward(grad)
    expected = (reference.grad.clone(), module.linear.weight.grad.clone())
    module.zero_grad(set_to_none=True)
    received, sent = torch.empty(4, 8, device="meta").requires_grad_(), torch.empty(4, width, device="meta")
    runner = StageRunner(module, 1, 3, (received,), (sent.requires_grad_(),), torch.device("cpu"))
    (output,) = runner.forward(0, [x.clone()], {})
    runner.release(0)
    storages = [output] + ([output._base] if output._base is not None else [])
    assert all(t.untyped_storage().nbytes() == 0 for t in storages) == freed
    assert output.untyped_storage().nbytes() == (0 if freed else (4 * 8 * 4))
    (input_grad,) = runner.backward(0, [grad], None, last=True)
    torch.testing.assert_close(input_grad, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(module.linear.weight.grad, expected[1], rtol=0, atol=0)
    assert not runner.pending


def test_a_plan_the_model_cannot_be_cut_into_is_refused():
    model = _small_gpt()
    with pytest.raises(TensorOptError, match="do not split into 3 equal pipeline stages"):
        split_spec(model, _plan(3, 1))
    with pytest.raises(TensorOptError, match="the plan puts"):
        split_spec(model, _plan(2, 1))              # 2 copies per stage in the model, 1 in the plan


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("tp", [1, 2])
def test_interleaved_virtual_stages_match_one_process(reference, chosen, tmp_path, tp):
    """pp2 x 2 virtual stages (interleaved 1F1B over 4 micro-batches): pipeline rank 0 holds layers 0 and 2 with
    the embedding, rank 1 layers 1 and 3 with the tied head, whose gradients are summed over the two. With tp2
    (4 workers, no data parallelism: plain DTensor gradients, the embedding's one replicated) the stages' linears
    and the vocabulary are split too."""
    plan = dataclasses.replace(_two_stages(chosen, 2, 1), virtual_stages=2, devices=2 * tp, tp=tp,
                               tp_branches=("attn", "mlp") if tp > 1 else ())
    data = _launch(plan, tmp_path, 2 * tp)
    np.testing.assert_allclose(data["losses"], reference, rtol=LOSS_RTOL)


@pytest.fixture(scope="module")
def stages_alone(tmp_path_factory):
    """tests/train_stages.py (a tiny GPT built on meta) run alone in float32: its losses."""
    return losses_alone(STAGES, tmp_path_factory.mktemp("stages") / "alone.json")


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("strategies, sp_layers", [
    ((("none", True, 2),), {"0", "1", "2", "3"}),       # both copies of a stage SP: the share handed on between them
    ((("selective", True, 1), ("none", False, 1)), {"0", "2"}),   # one SP copy, recomputed, then a whole one
], ids=["sp-sp", "sp-whole"])
def test_sequence_parallel_copies_inside_two_tensor_parallel_stages_match_one_process(chosen, stages_alone, tmp_path,
                                                                                     strategies, sp_layers):
    """pp2 x tp2 (4 workers, float32, 4 micro-batches of 2) with sequence-parallel copies: where both stages' copies
    are SP the stream crosses between them as each rank's share of the sequence; where a stage has a whole copy it
    slices the stream at its first SP copy and gathers it at its last; inside a copy the stream is a
    sequence-sharded DTensor. The losses are the script's alone, and exactly the
    SP copies' norms are replicated DTensors (their gradients summed over the tokens' shares)."""
    plan = dataclasses.replace(_two_stages(chosen, 2, 0), devices=4, tp=2, tp_branches=("attn", "mlp"),
                               blocks=(BlockPlan("layers.*", tuple((LayerStrategy(r, sp), n)
                                                                   for r, sp, n in strategies)),))
    data = _launch(plan, tmp_path, 4, STAGES)
    np.testing.assert_allclose(data["losses"], stages_alone, rtol=LOSS_RTOL)
    norms = {name.replace("_checkpoint_wrapped_module.", "").split(".")[1] for name in data["replicated"]
             if ".norm" in name}
    assert norms == sp_layers & {"0", "1"}             # rank 0 holds stage 0: layers 0 and 1


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_sequence_parallel_copies_inside_interleaved_virtual_stages_match_one_process(chosen, stages_alone, tmp_path):
    """pp2 x tp2 x 2 virtual stages (4 workers, float32, 4 micro-batches of 2): rank 0 holds stages 0 and 2
    (layers 0 and 2), rank 1 stages 1 and 3 (layers 1 and 3). The plan lists a device's copies: the first whole,
    the second sequence-parallel and recomputed, so the second virtual stage of each rank (layers 2 and 3) slices
    and gathers on its own. The losses are the script's alone, and exactly layer 2's norms are replicated DTensors
    on rank 0 (a copy indexed within its stage, not among its device's copies, reads the first copy's strategy
    in both stages: no SP at all, as measured before the fix)."""
    plan = dataclasses.replace(_two_stages(chosen, 2, 0), devices=4, tp=2, tp_branches=("attn", "mlp"),
                               virtual_stages=2,
                               blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 1),
                                                              (LayerStrategy("selective", True), 1))),))
    data = _launch(plan, tmp_path, 4, STAGES)
    np.testing.assert_allclose(data["losses"], stages_alone, rtol=LOSS_RTOL)
    norms = {name.replace("_checkpoint_wrapped_module.", "").split(".")[1] for name in data["replicated"]
             if ".norm" in name}
    assert norms == {"2"}


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_meta_built_stages_in_bf16_mixed_match_one_process_in_bf16_mixed(chosen, tmp_path):
    """pp2 of a tiny GPT built on meta, in bf16-mixed, one micro-batch of the whole batch: the stages are traced on
    fake CPU tensors under the CPU's autocast (autocast acts on no meta tensor), so their graphs cast where the
    script alone in bf16-mixed casts: the losses are its losses (the same products in the same order; with 4
    micro-batches the bf16 weight gradients are rounded per micro-batch, 3.1e-5 apart after 3 steps), and the
    first step's is not the float32 one (it did compute in bf16)."""
    script = str(REPO / "tests" / "train_stages.py")
    mixed = losses_alone(script, tmp_path / "mixed.json", precision="bf16-mixed")
    true32 = losses_alone(script, tmp_path / "true32.json")
    plan = dataclasses.replace(_two_stages(chosen, 8, 0), precision="bf16-mixed")
    data = _launch(plan, tmp_path, 2, script)
    np.testing.assert_allclose(data["losses"], mixed, rtol=1e-6)     # measured: equal (the same ops, one micro-batch)
    assert abs(data["losses"][0] / true32[0] - 1) > 1e-6


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_three_dimensional_interleaved_meta_built_matches_one_process(chosen, tmp_path):
    """pp2 x tp2 x dp2 with 2 virtual stages per rank (8 workers), ZeRO 3, sequence parallelism and selective
    recomputation on each device's second copy, a tiny GPT built on meta: the losses are the script's alone, the
    norms of exactly that copy (layer 2 on rank 0) are (dp, tp) DTensors (replicated over tp: SP ran there;
    the others only FSDP2's dp shards), and rank 0 holds stages 0 and 2 (layers 0 and 2, the
    embedding) with every linear split over tp (Megatron's columns and rows) and then over dp (FSDP2's rows),
    the embedding by vocabulary (plan.json's vocab_parallel; the tied head on the last stage too, its loss
    under loss_parallel)."""
    script = str(REPO / "tests" / "train_stages.py")
    alone = losses_alone(script, tmp_path / "alone.json")
    strategies = ((LayerStrategy("none"), 1), (LayerStrategy("selective", True), 1))
    plan = dataclasses.replace(chosen, devices=8, dp=2, tp=2, pp=2, virtual_stages=2, zero=3, offload=False,
                               micro_batch=1, global_batch=8, tp_branches=("attn", "mlp"),
                               blocks=(BlockPlan("layers.*", strategies),))
    data = _launch(plan, tmp_path, 8, script)
    np.testing.assert_allclose(data["losses"], alone, rtol=LOSS_RTOL)
    assert {name.replace("_checkpoint_wrapped_module.", "").split(".")[1] for name, dims in data["mesh_dims"].items()
            if ".norm" in name and dims == 2} == {"2"}
    shapes = {name.replace("_checkpoint_wrapped_module.", ""): shape for name, shape in data["local_shapes"].items()}
    assert {name.split(".")[1] for name in shapes if name.startswith("layers.")} == {"0", "2"}
    assert shapes["embed.weight"] == [64 // 4, 32]              # the vocabulary split over tp, then rows over dp
    for layer in ("0", "2"):
        assert shapes[f"layers.{layer}.attn.qkv.weight"] == [3 * 32 // 4, 32]       # columns / tp, then rows / dp
        assert shapes[f"layers.{layer}.attn.proj.weight"] == [32 // 2, 32 // 2]     # rows / dp, columns / tp
        assert shapes[f"layers.{layer}.mlp.up.weight"] == [64 // 4, 32]


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_meta_built_stage_gets_storage_for_its_shards_only(tmp_path):
    """pp2 x dp2 under ZeRO 3 (4 workers) of tests/train_measured.py's meta-built GPT (4 layers of 0.79 MB in
    float32; a stage holds 2 of them and its end of the tied embedding): each rank's stage is sharded by FSDP2 on
    the meta device before it gets storage, so from ``parallelize`` until the optimizer is made a rank never holds
    its whole stage at once (placed first and sharded then, as before this test, it did), only its half and the
    initialisation's transient full-size copies of what one ``init_fn`` call touches (an MLP's two linears, 0.53
    MB: measured peak 1.53 MB), and ends with half its stage's parameters; the losses are the script's alone."""
    script = str(REPO / "tests" / "train_measured.py")
    alone_out = tmp_path / "alone"
    subprocess.run([sys.executable, script, "--out", alone_out], check=True, env=ENV, capture_output=True, timeout=300)
    alone = json.loads((tmp_path / "alone.0.json").read_text())
    plan = Plan(devices=4, dp=2, tp=1, pp=2, micro_batch=1, global_batch=4, zero=3, precision="32-true",
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 2),)),))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", 4, "--plan", path, "--run-dir",
                           tmp_path / "run", "--", "--out", tmp_path / "got", cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    layer_bytes = 12 * 128 * 128 * 4 + 13 * 128 * 4        # a layer's weights and biases, float32
    stage_bytes = 2 * layer_bytes + 256 * 128 * 4           # two layers and the embedding (or the tied head)
    for rank in range(4):
        got = json.loads((tmp_path / f"got.{rank}.json").read_text())
        assert got["resident_parameter_bytes"] <= stage_bytes / 2 + 4096, (rank, got)
        assert got["peak_bytes"] < stage_bytes, (rank, got["peak_bytes"], stage_bytes)
        np.testing.assert_allclose(got["losses"], alone["losses"], rtol=LOSS_RTOL)
