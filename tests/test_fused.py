"""Fused projections under tensor parallelism, in one process: which features each view reads (``graph.views``),
how a column linear's output is read (``space.fused``), which branches run on one rank's share at capture
(``space.tp_check``), and what the planner then offers: never a branch whose code cannot be sharded."""

import os

import pytest
import torch
from conftest import REPO

import tensoropt
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.graph.fold import fold
from tensoropt.graph.views import FULL, IRREGULAR, footprint
from tensoropt.search.ft import SearchSpace, search
from tensoropt.space.block import analyse_block
from tensoropt.space.fused import segment_order
from tensoropt.space.tp_check import tp_checks
from tensoropt.space.tp_layout import tp_layout

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_script(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, REPO / ("tests" if name == "train_fused" else "examples")
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FUSED, HF = load_script("train_fused"), load_script("train_hf")
IDS = torch.zeros(2, 16, dtype=torch.long)


def captured(attention="chunk", mlp="plain"):
    model = FUSED.GPT(96, 16, 32, 4, 2, attention, mlp)
    return tensoropt.capture(model, (IDS, IDS), cache=False).graph


def captured_hf(arch: str):
    return tensoropt.capture(HF.build(arch, 16), {"input_ids": IDS, "labels": IDS}, cache=False).graph


def branches(graph):
    (block,) = fold(graph).blocks
    space = analyse_block(block.ops, 16, checks=tp_checks(graph, block.name))
    return {b.name: b for b in space.branches}, dict(space.refused)


def test_footprints_of_views_name_the_features_read():
    qkv = torch.empty(2, 5, 12)                                   # 12 features: q | k | v of 4 each
    q, k, v = qkv.split(4, dim=-1)
    assert [footprint(t, qkv) for t in (q, k, v)] == [(0, 4, 1), (4, 4, 1), (8, 4, 1)]
    assert footprint(qkv.view(2, 5, 12), qkv) == FULL                # a reshape reads everything in order
    per_head = qkv.view(2, 5, 2, 3, 2)                             # 2 heads of (q, k, v) x 2
    assert footprint(per_head[..., 1, :], qkv) == (2, 2, 6, 2, 1)   # k: 2 features at 2 and 8
    assert footprint(qkv[..., ::5], qkv) == IRREGULAR               # a stride that does not tile the row


@pytest.mark.parametrize(("attention", "mlp", "attn_layout", "mlp_layout"), [
    ("chunk", "plain", ("segments", (32, 32, 32)), ("whole", (128,))),
    ("split", "gate-up", ("segments", (32, 32, 32)), ("segments", (128, 128))),
    ("interleaved", "plain", ("groups", (96,)), ("whole", (128,))),
])
def test_column_outputs_are_classified_by_how_the_code_reads_them(attention, mlp, attn_layout, mlp_layout):
    (block,) = fold(captured(attention, mlp)).blocks
    layouts = {b.name: b.layouts[0] for b in analyse_block(block.ops, 16).branches}
    assert (layouts["attn"].kind, layouts["attn"].segments) == attn_layout
    assert (layouts["mlp"].kind, layouts["mlp"].segments) == mlp_layout


def test_segment_order_gives_each_rank_its_part_of_every_segment():
    order = segment_order((4, 2, 2), 2)
    assert order == [0, 1, 4, 6, 2, 3, 5, 7]       # rank 0: q0 q1 k0 v0; rank 1: q2 q3 k1 v1


def test_hard_coded_splits_are_never_sharded_and_say_why():
    """nanoGPT's ``split(n_embd)`` and Phi-3's slices at config widths fail on a share; chunk(3) does not."""
    ok, refused = branches(captured("chunk", "gate-up"))
    assert (ok["attn"].max_tp, ok["mlp"].max_tp, refused) == (4, 64, {})
    ok, refused = branches(captured("split"))
    assert set(ok) == {"mlp"}
    assert "h.0.attn fails: ValueError: not enough values to unpack (expected 3, got 2)" in refused["attn"]
    ok, refused = branches(captured_hf("phi3"))
    assert set(ok) == {"mlp"} and ok["mlp"].layouts[0].segments == (128, 128)
    assert "self_attn.o_proj receives 64 input features where one rank holds 32 of 64" in refused["self_attn"]
    ok, refused = branches(captured_hf("gpt2"))                     # Conv1D projections
    assert set(ok) == {"mlp"} and "not enough values to unpack" in refused["attn"]


def test_layout_tells_the_runtime_which_projections_are_segmented():
    layout = tp_layout(captured("chunk", "gate-up"))["h.*"]
    assert layout == [
        {"branch": "attn", "column": ["attn.c_attn"], "row": ["attn.c_proj"], "max_tp": 4,
         "segments": {"attn.c_attn": [32, 32, 32]}},
        {"branch": "mlp", "column": ["mlp.gate_up_proj"], "row": ["mlp.down_proj"], "max_tp": 64,
         "segments": {"mlp.gate_up_proj": [128, 128]}}]
    assert "segments" not in tp_layout(captured("interleaved"))["h.*"][0]


def test_the_planner_never_offers_or_prices_a_refused_branch():
    graph = captured("split")
    model = ModelCost(graph, fold(graph), Cluster(8, 8, load_profile("h100-80gb")))
    points = search(model, 8, SearchSpace(global_batch=8)).points
    assert any(p.plan.tp > 1 for p in points)
    assert all(p.plan.tp_branches in ((), ("mlp",)) for p in points)
    plan = next(p.plan for p in points if p.plan.tp > 1)
    with pytest.raises(ValueError, match="cannot shard branch 'attn' of this model: on one of 2"):
        estimate(model, plan.__class__(**{**plan.__dict__, "tp_branches": ("attn", "mlp")}))
