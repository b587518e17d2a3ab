"""Tensor parallelism in the torch engine: real 2-process torchrun runs over gloo on CPU, compared with the
same script run alone, and the layout the launcher hands the workers (``tp_layout`` in plan.json)."""

import dataclasses
import json
import textwrap

import numpy as np
import pytest
from conftest import EXAMPLES
from workers import dry_run_plan, losses_alone, tensoropt_cli, tp2

import tensoropt
from tensoropt.errors import TensorOptError
from tensoropt.runtime.tensor_parallel import check_degree, sharded_branches
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan
from tensoropt.space.run_plan import RunPlan, tp_layout_from_json
from tensoropt.space.tp_layout import tp_layout

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multiprocess")]
GPT, LLAMA = str(EXAMPLES / "train_gpt.py"), str(EXAMPLES / "train_llama_hf.py")


def launch(script, plan: Plan, tmp_path, *script_args) -> dict:
    """``tensoropt launch --plan`` for 3 steps; the losses rank 0 wrote."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    out = tmp_path / "losses.json"
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", plan.devices, "--plan", path, "--engine",
                           "torch", "--run-dir", tmp_path / "run", "--", "--steps", 3, "--out", out, *script_args,
                           cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensor parallel 2" in result.stdout
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert written["tp_layout"], "the launcher must tell the workers which linears to shard"
    data = json.loads(out.read_text())
    assert (data["plan"], data["engine"]) == (plan.summary(), "torch")
    return data


def test_gpt_tp2_matches_one_process(tmp_path):
    """Both branches sharded, 2 micro-batches accumulated, 2 of 4 layers recomputed; AdamW's foreach kernels
    (CUDA's default), which refuse a parameter list mixing the sharded linears' DTensors and the plain norms."""
    alone = losses_alone(GPT, tmp_path / "alone.json", "--foreach")
    (tmp_path / "dry").mkdir()
    plan = tp2(dry_run_plan(GPT, tmp_path / "dry"), ("attn", "mlp"), micro_batch=4, full_recompute=2)
    launched = launch(GPT, plan, tmp_path, "--foreach")
    np.testing.assert_allclose(launched["losses"], alone, rtol=2e-5)


def test_hugging_face_llama_gqa_tp2_matches_one_process(tmp_path):
    """4 query heads on 2 key/value heads: each rank runs 2 query heads on its one key/value head."""
    alone = losses_alone(LLAMA, tmp_path / "alone.json")
    (tmp_path / "dry").mkdir()
    plan = tp2(dry_run_plan(LLAMA, tmp_path / "dry"), ("self_attn", "mlp"), micro_batch=8)
    launched = launch(LLAMA, plan, tmp_path)
    np.testing.assert_allclose(launched["losses"], alone, rtol=2e-5)


def test_gpt_tp2_with_fsdp2_over_dp2_matches_one_process(tmp_path):
    """A 2 x 2 mesh: tensor parallelism inside, FSDP2 (ZeRO 3) over the data-parallel axis; 4 workers; foreach
    AdamW over DTensors of two meshes (the sharded linears on dp x tp, the rest on dp)."""
    alone = losses_alone(GPT, tmp_path / "alone.json", "--foreach")
    (tmp_path / "dry").mkdir()
    plan = tp2(dry_run_plan(GPT, tmp_path / "dry", devices=4), ("attn", "mlp"), micro_batch=2, full_recompute=1)
    launched = launch(GPT, dataclasses.replace(plan, dp=2, zero=3), tmp_path, "--foreach")
    np.testing.assert_allclose(launched["losses"], alone, rtol=2e-5)


PROBE = textwrap.dedent("""
    import json, sys
    import torch
    from torch.distributed.tensor import DTensor
    import tensoropt
    from tensoropt.models.transformer import DecoderLM, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                            vocab_size=128)
    tokens = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(1))
    model, _, run = tensoropt.parallelize(DecoderLM(cfg), lambda p: torch.optim.AdamW(p, lr=1e-3),
                                          example_inputs=(tokens[:1, :-1], tokens[:1, 1:]), global_batch=8)
    loss = run.train_step((tokens[:, :-1], tokens[:, 1:]))
    local = {n: [list(p.to_local().shape) if isinstance(p, DTensor) else None, list(p.shape)]
             for n, p in model.named_parameters()}
    with open(f"{sys.argv[1]}.{run.rank}", "w") as f:
        json.dump({"loss": loss, "params": local}, f)
    run.close()
""")


def test_only_the_planned_branches_are_sharded(tmp_path):
    """tp_branches=("mlp",): the MLP linears hold half their weights, attention stays whole and replicated."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    (tmp_path / "dry").mkdir()
    plan = tp2(dry_run_plan(script, tmp_path / "dry"), ("mlp",), micro_batch=8)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", 2, "--plan", path, "--run-dir",
                           tmp_path / "run", "--", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1)]
    assert ranks[0]["loss"] == ranks[1]["loss"]
    params = ranks[0]["params"]
    assert params["layers.0.mlp.up.weight"] == [[128, 64], [256, 64]]       # column: output features split
    assert params["layers.3.mlp.up.bias"] == [[128], [256]]
    assert params["layers.3.mlp.down.weight"] == [[64, 128], [64, 256]]     # row: input features split
    assert params["layers.3.mlp.down.bias"] == [[64], [64]]                 # added once, after the all-reduce
    assert params["layers.0.attn.qkv.weight"] == [None, [192, 64]]          # attention not planned: replicated
    assert params["embed.weight"] == [[64, 64], [128, 64]]                  # vocabulary split (rows)
    assert "head.weight" not in params                                      # tied to it: still one parameter


def test_layout_comes_from_the_graphs_branches(write_json):
    """Branches and their largest degrees (heads, features; degrees are checked up to 64 at capture)."""
    graph = tensoropt.capture(str(EXAMPLES / "llama2-7b-hf-config.json"), seq_len=128).graph
    assert tp_layout(graph) == {"model.layers.*": [
        {"branch": "self_attn", "column": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "row": ["self_attn.o_proj"], "max_tp": 32},
        {"branch": "mlp", "column": ["mlp.gate_proj", "mlp.up_proj"], "row": ["mlp.down_proj"], "max_tp": 64}]}
    cfg = {"family": "llama", "hidden_size": 128, "num_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
           "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 100}
    layout = tp_layout(tensoropt.capture(write_json("gqa.json", cfg)).graph)
    assert [(b["branch"], b["column"], b["row"], b["max_tp"]) for b in layout["layers.*"]] == [
        ("attn", ["attn.qkv"], ["attn.proj"], 2), ("mlp", ["mlp.gate", "mlp.up"], ["mlp.down"], 64)]


def test_plans_the_runtime_cannot_shard_are_refused():
    layout = {"layers.*": [{"branch": "attn", "column": ["attn.qkv"], "row": ["attn.proj"], "max_tp": 2},
                           {"branch": "mlp", "column": ["mlp.up"], "row": ["mlp.down"], "max_tp": 256}]}
    plan = Plan(devices=4, dp=1, tp=4, pp=1, micro_batch=1, global_batch=1, tp_branches=("mlp",),
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 2),)),))
    typed = tp_layout_from_json(layout)
    assert sharded_branches(RunPlan(plan, tp_layout=typed)) == {"layers.*": typed[0][1][1:]}
    assert typed[0][1][1].to_json() == layout["layers.*"][1]
    with pytest.raises(TensorOptError, match="has no 'tp_layout'"):
        sharded_branches(RunPlan(plan))
    with pytest.raises(TensorOptError, match="made for another model"):
        sharded_branches(RunPlan(plan, tp_layout=tp_layout_from_json({"blocks.*": layout["layers.*"]})))
    with pytest.raises(TensorOptError, match="tp must divide 2"):
        check_degree("layers.*", typed[0][1], 4)
