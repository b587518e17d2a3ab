"""The vocabulary split over tensor-parallel ranks (embedding, LM head, cross-entropy under ``loss_parallel``):
which models allow it, read from the captured graph; the cost model pricing the layout that runs (split, or
replicated where the model or the degree refuses it); and real 2-worker gloo runs training to the losses of
the script run alone, with whole weights out of ``full_state_dict`` and checkpoints."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import EXAMPLES, LAUNCH_CWD, REPO
from torch import nn
from train_zloss import build as build_zloss
from workers import LOSS_RTOL, assert_weights_alike, dry_run_plan, losses_alone, tensoropt_cli, tp2

from tensoropt.cost.layer import LooseOps
from tensoropt.cost.model import ModelCost
from tensoropt.cost.profile import PROFILES_DIR, Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.graph.capture import trace_module
from tensoropt.graph.fold import fold
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.parallel.vocab_parallel import apply_vocab_parallel, check_vocab, vocab_entry
from tensoropt.space.plan import Plan
from tensoropt.space.run_plan import RunPlan, VocabSplit
from tensoropt.space.tp_check import check_tensor_parallel, with_tp_checks
from tensoropt.space.vocab import check_vocab_modules, vocab_layout, with_vocab_check

GPT, HF, ZLOSS = str(EXAMPLES / "train_gpt.py"), str(EXAMPLES / "train_hf.py"), str(REPO / "tests" / "train_zloss.py")
H, SEQ = 64, 32


def gpt(vocab: int = 128, tie: bool = True) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(hidden_size=H, num_layers=2, num_attention_heads=4, ffn_hidden_size=4 * H,
                                       seq_length=SEQ, vocab_size=vocab, tie_embeddings=tie))


def capture(model: nn.Module, vocab: int = 128):
    """The graph as ``tensoropt.parallelize`` writes it in capture mode (the module check recorded)."""
    x = torch.randint(0, vocab, (1, SEQ))
    graph = trace_module(model, (x, x), type(model).__name__, {"seq_len": str(SEQ)}, require_loss=True)
    graph = with_tp_checks(graph, check_tensor_parallel(model, (x, x), graph))
    return with_vocab_check(graph, check_vocab_modules(model, graph))


def loose_cost(graph, tp: int):
    model = ModelCost(graph, fold(graph), Cluster(4, 4, load_profile(str(PROFILES_DIR / "cpu-2core.json"))))
    return model.loose(tp, 1, 1)[0]


@pytest.mark.parametrize("tie", [True, False])
def test_the_embedding_and_head_come_from_the_graph(tie):
    layout = vocab_layout(capture(gpt(tie=tie)))
    assert (layout.embedding, layout.head, layout.tied, layout.vocab, layout.refused) == ("embed", "head", tie, 128, "")
    assert layout.for_tp(2) == {"enabled": True, "embedding": "embed", "head": "head", "tied": tie, "vocab": 128}


class ScaledHead(nn.Module):
    """An LM head that is no ``nn.Linear`` (``ColwiseParallel`` would not shard it)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, H) * 0.02)

    def forward(self, x):
        return F.linear(x, self.weight)


def test_models_that_cannot_split_the_vocabulary_say_why():
    assert "logits are also used by" in vocab_layout(capture(build_zloss())).refused   # z-loss reads them twice
    odd = gpt()
    odd.head = ScaledHead(128)
    assert "head is a ScaledHead, not an Linear" in vocab_layout(capture(odd)).refused
    assert gpt(vocab=130) and vocab_layout(capture(gpt(vocab=130), 130)).for_tp(4) == {
        "enabled": False, "reason": "tp 4 does not divide the vocabulary of 130"}


def test_the_head_is_priced_as_it_runs():
    """Split: the tied table's V x h weights and the logits divide by tp, plus two all-reduces of the hidden state.
    Replicated (z-loss; or tp 4 on a vocabulary of 130): every rank holds the whole table and computes the whole
    logits, and pays no vocabulary all-reduce."""
    split1, split2 = loose_cost(capture(gpt()), 1), loose_cost(capture(gpt()), 2)
    assert split1.parameters - split2.parameters == 128 * H / 2
    logits_bytes = SEQ * 128 * 4                                # float32 (1, 32, 128) kept for the backward
    assert split1.activation_bytes - split2.activation_bytes >= logits_bytes / 2
    zloss = capture(build_zloss())
    assert loose_cost(zloss, 2) == loose_cost(zloss, 1)
    odd = capture(gpt(vocab=130), 130)
    assert loose_cost(odd, 1).parameters - loose_cost(odd, 2).parameters == 130 * H / 2
    assert loose_cost(odd, 4) == loose_cost(odd, 1)
    ops = ModelCost(odd, fold(odd), Cluster(4, 4, load_profile(str(PROFILES_DIR / "cpu-2core.json")))).tail_ops
    assert LooseOps(ops, Cluster(4, 4, load_profile("h100-80gb")), vocab_layout(odd)).split(2)


def test_the_runtime_refuses_a_layout_the_model_does_not_have():
    """Hand-edited or stale plans stop in one line before anything is sharded."""
    entry = VocabSplit(True, embedding="embed", head="head", tied=False, vocab=128)
    embedding, head = nn.Embedding(128, H), nn.Linear(H, 128, bias=False)
    check_vocab(entry, embedding, head, 2)
    with pytest.raises(TensorOptError, match="does not divide the vocabulary of 128"):
        check_vocab(entry, embedding, head, 3)
    with pytest.raises(TensorOptError, match="has 130 rows"):
        check_vocab(entry, nn.Embedding(130, H), head, 2)
    head.weight = embedding.weight
    with pytest.raises(TensorOptError, match="not tied"):
        check_vocab(entry, embedding, head, 2)
    plan = RunPlan(Plan(devices=2, dp=1, tp=2, pp=1, micro_batch=1, global_batch=1))
    assert not vocab_entry(plan).enabled                           # written without one: replicated
    with pytest.raises(TensorOptError, match="a ScaledHead where an Linear was captured"):
        model = gpt()
        model.head = ScaledHead(128)
        apply_vocab_parallel(model, dataclasses.replace(plan, vocab_parallel=entry), None)


# ---- real workers (3 launches) ----------------------------------------------------------------------------

def launch(script, tmp_path, *args, devices: int = 2, plan=None, script_args=()) -> dict:
    """``tensoropt launch`` (``--tp 2``, or ``plan``) for 3 steps; the plan.json it wrote and rank 0's output."""
    choose = ("--tp", 2)
    if plan is not None:
        (tmp_path / "plan.json").write_text(json.dumps(plan.to_json()))
        choose = ("--plan", tmp_path / "plan.json", "--engine", "torch")
    out = tmp_path / "out.json"
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", devices, *choose, "--run-dir",
                           tmp_path / "run", *args, "--", "--steps", 3, "--out", out, *script_args, cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "run" / "plan.json").read_text()) | {"out": json.loads(out.read_text()),
                                                                         "stdout": result.stdout}


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_gpt_tp2_splits_the_tied_vocabulary_and_saves_whole_weights(tmp_path):
    """The built-in GPT (tied embedding and head) under tp2 with both branches sharded, 2 micro-batches accumulated,
    2 of 4 layers recomputed and AdamW's foreach kernels (CUDA's default, which refuse a parameter list mixing the
    sharded linears' DTensors and the plain norms): its losses, its final weights gathered by ``full_state_dict``,
    and the weights of its last checkpoint loaded into the model built whole, all equal the script run alone.
    (This run was also tests/test_tensor_parallel.py's GPT tp2 case; the launcher's own --tp 2 choice is launched
    below and in tests/test_fused_launch.py.)"""
    alone = losses_alone(GPT, tmp_path / "alone.json", "--foreach", "--save-params", tmp_path / "alone.npy")
    (tmp_path / "dry").mkdir()
    plan = tp2(dry_run_plan(GPT, tmp_path / "dry"), ("attn", "mlp"), micro_batch=4, full_recompute=2)
    ckpt = tmp_path / "ckpt"
    run = launch(GPT, tmp_path, "--checkpoint-dir", ckpt, "--checkpoint-every", 3, plan=plan,
                 script_args=("--foreach", "--save-params", tmp_path / "tp.npy"))
    assert run["tp"] == 2 and run["vocab_parallel"] == {"enabled": True, "embedding": "embed", "head": "head",
                                                        "tied": True, "vocab": 128}
    assert (run["out"]["plan"], run["out"]["engine"]) == (plan.summary(), "torch")
    assert "tensor parallel 2" in run["stdout"] and run["tp_layout"], "the workers must be told which linears to shard"
    assert "vocabulary split over tp" in run["stdout"]
    np.testing.assert_allclose(run["out"]["losses"], alone, rtol=LOSS_RTOL)
    # AdamW divides each gradient by its own running size, so a weight whose gradient is near float32 rounding
    # (biases near zero) moves by up to lr either way (workers.assert_weights_alike says how far, and why)
    whole, sharded = np.load(tmp_path / "alone.npy"), np.load(tmp_path / "tp.npy")
    assert sharded.shape == whole.shape                           # every weight whole: embed.weight is 128 x 64
    assert_weights_alike(sharded, whole, steps=3)
    # embed.weight (first) on its own, gathered from its vocabulary shards in order: a shard out of place moves every
    # one of its rows far beyond the bulk tolerance; the same tolerances as the whole (its tied gradient sums the
    # head's and the lookup's, so some of its elements are near rounding noise too)
    assert_weights_alike(sharded[:128 * 64], whole[:128 * 64], steps=3)
    model = DecoderLM(TransformerConfig(hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=256,
                                        seq_length=32, vocab_size=128))
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(next(ckpt.glob("step-*"))))
    assert state["embed.weight"].shape == (128, 64)
    loaded = torch.cat([state[k].flatten() for k in sorted(state)])      # as train_gpt.py --save-params flattens
    assert_weights_alike(loaded.numpy(), whole, steps=3)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_hugging_face_gpt2_tied_embeddings_tp2(tmp_path):
    """``GPT2LMHeadModel`` (``tie_word_embeddings``): ``wte`` and ``lm_head`` stay one parameter, its gradient the
    sum of both uses, and Hugging Face's own loss runs on the vocabulary-split logits."""
    alone = losses_alone(HF, tmp_path / "alone.json", "--arch", "gpt2")
    run = launch(HF, tmp_path, script_args=("--arch", "gpt2"))
    assert run["vocab_parallel"] == {"enabled": True, "embedding": "transformer.wte", "head": "lm_head",
                                     "tied": True, "vocab": 128}
    np.testing.assert_allclose(run["out"]["losses"], alone, rtol=LOSS_RTOL)


# FSDP2 (ZeRO 3) over dp2 on top of the vocabulary-split embedding and head over tp2 (4 workers) is asserted by
# tests/test_sequence_parallel.py::test_gpt_tp2_sequence_parallel_with_fsdp2_over_dp2_matches_one_process.


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_model_that_cannot_split_the_vocabulary_is_priced_and_run_replicated(tmp_path):
    """The z-loss GPT under tp2: plan.json says why the vocabulary stays replicated, the launch summary too, its
    predicted memory prices the whole head on each rank, and it trains to the losses of the script run alone."""
    alone = losses_alone(ZLOSS, tmp_path / "alone.json")
    run = launch(ZLOSS, tmp_path)
    assert run["tp"] == 2 and not run["vocab_parallel"]["enabled"]
    assert "logits are also used by" in run["vocab_parallel"]["reason"]
    assert "vocabulary replicated (the logits are also used" in run["stdout"]
    np.testing.assert_allclose(run["out"]["losses"], alone, rtol=LOSS_RTOL)
