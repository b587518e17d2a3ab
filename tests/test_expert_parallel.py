"""Expert parallelism in the torch engine (``runtime.parallel.expert_parallel``): Hugging Face MoE models (Mixtral, 4
experts; Qwen3-MoE, 8 experts; top-2) trained by 4 real gloo workers with each rank holding E / ep experts, tokens
sent to them and back by all-to-all, reach the losses of ``examples/train_hf.py`` run alone (``LOSS_RTOL``) and its
final weights (``assert_weights_alike``), under ZeRO 0 (DDP beside the experts' own reduction), 1, 2 and 3 (FSDP2 on
the experts over the edp ranks), with tensor parallelism on the attention, across a checkpoint that changes ep, and
with dense layers before the MoE ones (two blocks of one module pattern, each run as its own plan says).

Why the weights are compared in every launch, not only the losses: AdamW divides each step by the gradient's own
size, so a gradient scaled wrongly (an expert gradient divided by dp twice, as FSDP2 over one edp rank once did)
moves the losses by under 1e-6 but thousands of expert weights by ~lr (where gradients are near AdamW's eps).

Routing: top-k takes the k largest router probabilities, so a plan whose router probabilities differ from the
script's alone by more than the gap between a token's k-th and (k+1)-th probability would send it elsewhere.
``test_routing_margins_dwarf_what_a_plan_changes`` replays the script alone and measures the smallest such gap in the
steps these tests run: 1.4e-5 (Mixtral, 3 steps) and 9.7e-7 (Qwen3-MoE, 2 steps: its third step has a gap of 4.5e-8,
so its launches run 2). What a plan changes in those probabilities: at step 0 the weights are the same and every
token's router input differs only by the rounding of reductions over other row counts (~1e-7 relative of logits of
~1e-2: ~1e-9 in probability); after a step the weights differ by ~1e-7 (the gradients' summation order), moving a
probability near 1/E by ~1e-8. So no choice can flip, on any CPU kind; and were one to, it would move the loss by
~1e-5 at most (measured: the runner-up forced in for one token per layer moves Mixtral's loss by 1.0-1.3e-5,
Qwen3-MoE's by 2-5e-6).
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import EXAMPLES, LAUNCH_CWD
from workers import ENV, LOSS_RTOL, assert_weights_alike, launched_with_plan, probe_under_torchrun, tensoropt_cli

from tensoropt.errors import TensorOptError
from tensoropt.runtime.parallel.expert_parallel import check_plan, experts_modules, regroup_order
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

HF_SCRIPT = str(EXAMPLES / "train_hf.py")
STEPS = {"mixtral": 3, "qwen3_moe": 2, "deepseek_v3": 3,        # see the module doc: routing margins
         "qwen3_moe_dense_first": 3}
_ALONE: dict[str, tuple[list[float], np.ndarray]] = {}


def _build(arch: str) -> torch.nn.Module:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_hf
    finally:
        sys.path.remove(str(EXAMPLES))
    return train_hf.build(arch, 32)


def _alone(arch: str, tmp_path_factory) -> tuple[list[float], np.ndarray]:
    """The script run by hand (float32): its losses and final weights, once per test process and architecture."""
    if arch not in _ALONE:
        out = tmp_path_factory.mktemp(f"alone-{arch}")
        subprocess.run([sys.executable, HF_SCRIPT, "--arch", arch, "--steps", str(STEPS[arch]), "--out",
                        out / "losses.json", "--save-params", out / "params.npy"], check=True, env=ENV,
                       capture_output=True, timeout=300)
        _ALONE[arch] = json.loads((out / "losses.json").read_text())["losses"], np.load(out / "params.npy")
    return _ALONE[arch]


def _plan(ep: int, zero: int, tp: int = 1, **changes) -> Plan:
    return Plan(devices=4, dp=4 // tp, tp=tp, pp=1, micro_batch=2, global_batch=8, zero=zero, ep=ep,
                tp_branches=("self_attn",) if tp > 1 else (), precision="32-true", dtype="float32",
                master_weights=False, **{"blocks": (BlockPlan("model.layers.*", ((LayerStrategy("none"), 4),)),),
                                         **changes})


def test_regroup_order_puts_each_local_experts_rows_together():
    # rows arrived as (rank 0: expert 0 x2, expert 1 x1), (rank 1: expert 0 x1, expert 1 x3)
    counts = torch.tensor([[2, 1], [1, 3]])
    arrived = torch.tensor([0, 0, 1, 10, 11, 11, 11])       # tens digit: source rank, unit: local expert
    assert arrived[regroup_order(counts)].tolist() == [0, 0, 10, 1, 11, 11, 11]
    assert regroup_order(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


@pytest.mark.parametrize("changes, line", [
    (dict(pp=2, dp=2, ep=2), "expert parallelism does not run with pipeline stages: plan with --pp 1"),
    (dict(cp=2, dp=2, ep=2), "expert parallelism does not run with context parallelism: plan with --cp 1"),
    (dict(compile=True), "expert parallelism does not run with compiled blocks"),
    (dict(blocks=(BlockPlan("model.layers.*", ((LayerStrategy("none", True), 4),)),), tp=2, dp=2,
          tp_branches=("self_attn",)), "expert parallelism does not run with sequence parallelism"),
    (dict(devices=8, dp=8, ep=8), "has 4 experts, which do not split over ep 8: plan an ep that divides 4"),
])
def test_what_expert_parallelism_does_not_run_is_one_line(changes, line):
    plan = dataclasses.replace(_plan(2, 1), **changes)
    with pytest.raises(TensorOptError, match=line.replace("(", r"\(").replace(")", r"\)")):
        check_plan(plan, "torch", _build("mixtral"))


def test_deepspeed_a_model_without_hf_experts_and_the_builtin_moe_are_refused():
    model = _build("mixtral")
    assert [n for n, _ in experts_modules(model)] == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    with pytest.raises(TensorOptError, match="does not run with the DeepSpeed engine: launch with --engine torch"):
        check_plan(_plan(2, 1), "deepspeed", model)
    with pytest.raises(TensorOptError, match="has no Hugging Face experts module .*: plan it with ep 1"):
        check_plan(_plan(2, 1), "torch", _build("llama"))
    from tensoropt.models.transformer import DecoderLM, TransformerConfig
    builtin = DecoderLM(TransformerConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
                                          seq_length=16, vocab_size=50, num_experts=4))
    with pytest.raises(TensorOptError, match="does not run tensoropt's DecoderLM MoE .*: plan it with ep 1"):
        check_plan(_plan(2, 1), "torch", builtin)


@pytest.mark.parametrize("arch, smallest", [("mixtral", 1e-5), ("qwen3_moe", 5e-7)])
def test_routing_margins_dwarf_what_a_plan_changes(arch, smallest):
    """The script alone's training (as ``run.train_step`` does it alone: AdamW lr 1e-3, the same seeds), the gap
    between each token's k-th and (k+1)-th router probability in every layer and step these tests run (module doc)."""
    torch.manual_seed(0)
    model = _build(arch)
    tokens = torch.randint(0, model.config.vocab_size, (STEPS[arch], 8, 32), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gaps: list[float] = []

    def record(router, _args, out) -> None:
        probs = torch.softmax(out[0].detach().float(), -1).sort(-1, descending=True).values
        gaps.append(float((probs[:, router.top_k - 1] - probs[:, router.top_k]).min()))
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(record)
    losses = []
    for step in range(STEPS[arch]):
        optimizer.zero_grad()
        loss = model(input_ids=tokens[step], labels=tokens[step]).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(gaps) == 4 * STEPS[arch]
    assert min(gaps) > smallest, gaps
    assert losses == pytest.approx([4.8589, 4.8730, 4.8733][:STEPS[arch]] if arch == "mixtral"
                                   else [4.8674, 4.8503], abs=1e-4)      # the script's own run (examples/train_hf.py)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_dispatch_and_combine_match_hugging_faces_kernel_on_two_ranks(tmp_path):
    """``ExpertParallel`` on 2 ranks against ``grouped_mm_experts_forward`` on both ranks' tokens with all experts:
    outputs and token / routing-weight gradients bitwise (the same kernel on the same rows), expert gradients to
    float32 summation order, also with an expert no token chose and with a rank no row reaches."""
    per_rank = probe_under_torchrun("ep_dispatch_probe.py", tmp_path)
    for rank, routings in enumerate(per_rank):
        assert set(routings) == {"random", "expert 3 idle", "rank 1 idle"}
        for label, got in routings.items():
            assert got["output"] == got["tokens"] == got["routing weights"] == 0.0, (rank, label, got)
            assert got["gate_up_proj"] < 1e-6 and got["down_proj"] < 1e-6, (rank, label, got)
    assert per_rank[1]["rank 1 idle"]["rows received"] == 0 and per_rank[0]["rank 1 idle"]["rows received"] == 48


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("arch, ep, zero", [("mixtral", 2, 0), ("qwen3_moe", 4, 2), ("mixtral", 2, 3),
                                            ("qwen3_moe", 2, 1), ("deepseek_v3", 2, 1)])
def test_expert_parallel_plans_train_as_the_script_alone(arch, ep, zero, tmp_path, tmp_path_factory):
    """Each plan through the launcher. DeepSeek-V3-shaped (MLA attention, a shared expert beside 4 routed ones, grouped
    sigmoid routing, its first layer dense: 3 block copies, named by their slice of ``model.layers.*`` so that the
    dense layer is not one of them): its router is not replayed for margins, its launches matched the script alone
    to 1e-7 over 5 steps."""
    want_losses, want_params = _alone(arch, tmp_path_factory)
    copies = 3 if arch == "deepseek_v3" else 4
    name = "model.layers.*[1:4]" if arch == "deepseek_v3" else "model.layers.*"
    plan = _plan(ep, zero, blocks=(BlockPlan(name, ((LayerStrategy("none"), copies),)),))
    got = launched_with_plan(plan, tmp_path, 4, HF_SCRIPT, "--arch", arch, "--steps", STEPS[arch], params=True)
    assert got["plan"] == f"dp4 ep{ep} tp1 pp1 mb2x1 zero{zero} [{copies}xnone]"
    np.testing.assert_allclose(got["losses"], want_losses, rtol=LOSS_RTOL)
    assert_weights_alike(got["params"], want_params, STEPS[arch])


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_expert_parallel_beside_tensor_parallel_attention(tmp_path, tmp_path_factory):
    """dp2 x tp2 with ep2 (ZeRO 1), launched as the launcher plans it (its tp layout: the attention's q/k/v and o
    linears): attention sharded over tp, experts whole on both tp ranks of an ep rank, each tp index dispatching over
    its own ep ranks."""
    want_losses, want_params = _alone("mixtral", tmp_path_factory)
    plan = _plan(2, 1, tp=2)
    got = launched_with_plan(plan, tmp_path, 4, HF_SCRIPT, "--arch", "mixtral", "--steps", STEPS["mixtral"],
                             params=True)
    assert got["plan"] == "dp2 ep2 tp2 pp1 mb2x2 zero1 tp:self_attn [4xnone]"
    assert [b["branch"] for b in got["written"]["tp_layout"]["model.layers.*"]] == ["self_attn"]
    np.testing.assert_allclose(got["losses"], want_losses, rtol=LOSS_RTOL)
    assert_weights_alike(got["params"], want_params, STEPS["mixtral"])


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_dense_and_an_moe_block_of_one_pattern_run_each_its_own_plan(tmp_path, tmp_path_factory):
    """Qwen3-MoE with two dense layers, then two MoE ones (``mlp_only_layers``): two blocks whose copies are all
    ``model.layers.*``, named apart (``model.layers.*[0:2]``, ``[2:4]``). dp2 x tp2 with ep2 (ZeRO 1): the dense
    copies recomputed and their MLP sharded over tp (the MoE block has no tensor-parallel branch), the MoE copies'
    experts over ep; the workers find each block's copies by its name. Its routing margins over these 3 steps:
    5.4e-6 and more."""
    arch = "qwen3_moe_dense_first"
    want_losses, want_params = _alone(arch, tmp_path_factory)
    plan = Plan(devices=4, dp=2, tp=2, pp=1, micro_batch=2, global_batch=8, zero=1, ep=2, tp_branches=("mlp",),
                precision="32-true", dtype="float32", master_weights=False,
                blocks=(BlockPlan("model.layers.*[0:2]", ((LayerStrategy("full"), 2),)),
                        BlockPlan("model.layers.*[2:4]", ((LayerStrategy("none"), 2),))))
    got = launched_with_plan(plan, tmp_path, 4, HF_SCRIPT, "--arch", arch, "--steps", STEPS[arch], params=True)
    assert got["plan"] == "dp2 ep2 tp2 pp1 mb2x2 zero1 tp:mlp [2xfull] [2xnone]"
    # the attention is kept whole (Qwen3's q/k norms, examples/train_hf.py): the dense block's MLP is the one branch
    assert {block: [b["branch"] for b in branches] for block, branches in got["written"]["tp_layout"].items()} == \
        {"model.layers.*[0:2]": ["mlp"]}
    np.testing.assert_allclose(got["losses"], want_losses, rtol=LOSS_RTOL)
    assert_weights_alike(got["params"], want_params, STEPS[arch])


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_checkpoint_saved_under_ep4_resumes_under_ep2(tmp_path, tmp_path_factory):
    """Two steps under dp4 ep4 ZeRO 2 checkpointed, the third resumed under dp4 ep2 ZeRO 0: torch.distributed.checkpoint
    stores each expert tensor whole by name (its ep shards), so it loads into another ep, with the optimizer state."""
    want_losses, want_params = _alone("mixtral", tmp_path_factory)
    for name, plan, steps in [("a", _plan(4, 2), 2), ("b", _plan(2, 0), 3)]:
        (tmp_path / f"{name}.json").write_text(json.dumps(plan.to_json()))
        result = tensoropt_cli("launch", HF_SCRIPT, "--device", "cpu", "--gpus", 4, "--plan", tmp_path / f"{name}.json",
                               "--engine", "torch", "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 1,
                               "--run-dir", tmp_path / name, "--", "--arch", "mixtral", "--steps", steps, "--out",
                               tmp_path / f"{name}.out.json", "--save-params", tmp_path / f"{name}.npy",
                               cwd=LAUNCH_CWD, env=ENV)
        assert result.returncode == 0, result.stderr[-3000:]
    first, resumed = (json.loads((tmp_path / f"{n}.out.json").read_text())["losses"] for n in "ab")
    assert len(first) == 2 and len(resumed) == 1
    np.testing.assert_allclose(first + resumed, want_losses, rtol=LOSS_RTOL)
    assert_weights_alike(np.load(tmp_path / "b.npy"), want_params, 3)
    assert os.listdir(tmp_path / "ck")


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_the_memory_check_simulates_an_ep_plan_within_its_prediction(tmp_path):
    """``launch --dry-run --check-memory`` simulates rank 0's step of an ep plan on fake tensors (tokens exchanged at
    balanced routing, what the planner prices; fake tensors carry no routing counts): a Mixtral-shaped model
    (benchmarks/_moe_script.py, hidden 1024, 8 experts) under dp4 ep4 ZeRO 3 holds at most its prediction and within
    5% of it (benchmarks/moe_memory.py holds the other plans: 0.946-1.000)."""
    plan = Plan(devices=4, dp=4, tp=1, pp=1, micro_batch=2, global_batch=8, zero=3, ep=4, precision="bf16-mixed",
                engine="torch", master_weights=False,
                blocks=(BlockPlan("model.layers.*", ((LayerStrategy(), 4),)),))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    script = str(EXAMPLES.parent / "benchmarks" / "_moe_script.py")
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", 4, "--engine", "torch", "--plan", path,
                           "--precision", "bf16-mixed", "--run-dir", tmp_path / "sim", "--dry-run", "--check-memory",
                           cwd=LAUNCH_CWD, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    check = json.loads((tmp_path / "sim" / "memory_check.json").read_text())
    assert check["plan"] == plan.summary() and check["simulated"]["simulated"] is True
    ratio = check["simulated"]["peak_bytes"] / check["predicted"]["tensor_bytes"]
    assert 0.95 <= ratio <= 1.0, ratio


def test_a_given_plan_whose_ep_does_not_split_the_experts_is_one_line_before_any_worker(tmp_path):
    """``launch --plan`` with ep 3 for Mixtral's 4 experts: refused by the launcher in one line (the planner's words,
    ``space.experts``), no worker started (the runtime would refuse it in every rank)."""
    plan = dataclasses.replace(_plan(3, 1), devices=3, dp=3, global_batch=3, micro_batch=1)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", HF_SCRIPT, "--device", "cpu", "--gpus", 3, "--plan", path, "--run-dir",
                           tmp_path / "run", "--", "--arch", "mixtral", "--global-batch", 3, cwd=LAUNCH_CWD, env=ENV)
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert "4 experts do not divide by 3: pick an --ep dividing 4" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("arch, engine, zero, pp", [("mixtral", "deepspeed", 1, 1), ("qwen3_moe", "deepspeed", 3, 1),
                                                    ("mixtral", "torch", 0, 2)])
def test_moe_models_train_under_the_launchers_plans_without_ep(arch, engine, zero, pp, tmp_path, tmp_path_factory):
    """The rest of what the launcher offers a Hugging Face MoE model on 2 workers: DeepSpeed (ZeRO 1, ZeRO 3: its
    partitioned (E, ...) expert stacks gathered per module) and two pipeline stages (the grouped products traced
    into the stages), to the losses and weights of the script alone."""
    want_losses, want_params = _alone(arch, tmp_path_factory)
    plan = Plan(devices=2, dp=2 // pp, tp=1, pp=pp, micro_batch=4 if pp == 1 else 2, global_batch=8, zero=zero,
                precision="32-true", dtype="float32", master_weights=False,
                blocks=(BlockPlan("model.layers.*", ((LayerStrategy("none"), 4 // pp),)),))
    got = launched_with_plan(plan, tmp_path, 2, HF_SCRIPT, "--arch", arch, "--steps", STEPS[arch], engine=engine,
                             params=True)
    np.testing.assert_allclose(got["losses"], want_losses, rtol=LOSS_RTOL)
    assert_weights_alike(got["params"], want_params, STEPS[arch])
