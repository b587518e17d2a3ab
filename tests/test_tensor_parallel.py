"""Tensor parallelism in the torch engine: a real 2-process run that shards only the planned branches, and the
layout the launcher hands the workers (``tp_layout`` in plan.json). The launched runs compared with the script
alone are listed below."""

import json
import textwrap

import pytest
from conftest import EXAMPLES
from workers import dry_run_plan, tensoropt_cli, tp2

import tensoropt
from tensoropt.errors import TensorOptError
from tensoropt.runtime.parallel.tensor_parallel import check_degree, sharded_branches
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan
from tensoropt.space.run_plan import RunPlan, tp_layout_from_json
from tensoropt.space.tp_layout import tp_layout

pytestmark = [pytest.mark.slow]   # the tests that start workers share the "multiprocess" xdist group


# Launched tensor-parallel runs against the script alone, elsewhere: GPT under tp2 (both branches, 2 micro-batches
# accumulated, 2 of 4 layers recomputed, foreach AdamW over the sharded linears' DTensors and the plain norms) in
# tests/test_vocab_parallel.py::test_gpt_tp2_splits_the_tied_vocabulary_and_saves_whole_weights (with the weights
# and checkpoint); Hugging Face LLaMA with grouped-query attention (4 query heads on 2 key/value heads) in
# tests/test_sequence_parallel.py::test_hugging_face_llama_tp2_mixed_sequence_parallel_matches_one_process, whose
# first copy is tensor-parallel only; a 2 x 2 mesh with FSDP2 (ZeRO 3) over dp2 in
# tests/test_sequence_parallel.py::test_gpt_tp2_sequence_parallel_with_fsdp2_over_dp2_matches_one_process; the
# launcher's own --tp 2 choices in tests/test_fused_launch.py. Each launch costs ~15-25 s of CPU: one run asserts
# all that the same plan shows.


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


@pytest.mark.xdist_group("multiprocess")
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
