"""Folding finds repeated blocks from graph structure and reconstructs the graph exactly."""

import importlib.util
from collections import Counter

import pytest
import torch
from conftest import EXAMPLES, SMALL_GPT
from torch import nn

import tensoropt
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.graph.block_names import split_name
from tensoropt.graph.capture import trace_module
from tensoropt.graph.fold import fold
from tensoropt.runtime.blocks import check_copies, copies_of
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan, acts_per_copy


def assert_exact(graph, folded):
    """The folded graph gives back the same ops (multiset of signatures), the same edges, and in
    fact every op field, names included."""
    ops = folded.unfold()
    assert Counter(op.signature() for op in ops) == Counter(op.signature() for op in graph.ops)
    rebuilt = type(graph)(graph.name, ops, graph.params, graph.buffers, graph.inputs)
    assert sorted(rebuilt.edges()) == sorted(graph.edges())
    assert ops == graph.ops
    covered = sorted([op.index for op in folded.loose_ops]
                     + [o.start + j for b in folded.blocks for o in b.occurrences for j in range(len(b.ops))])
    assert covered == list(range(len(graph.ops)))           # a partition of the ops


def folded_exactly(graph):
    folded = fold(graph)
    assert_exact(graph, folded)
    return folded


def blocks(folded):
    return [(b.name, len(b.ops), b.repeats) for b in folded.blocks]


def test_gpt(write_json):
    graph = tensoropt.capture(write_json("gpt.json", SMALL_GPT)).graph
    folded = folded_exactly(graph)
    assert blocks(folded) == [("layers.*", 18, 4)]
    assert folded.ops_after_folding == len(graph.ops) - 3 * 18


def test_llama_with_gqa(write_json):
    cfg = {"family": "llama", "hidden_size": 128, "num_layers": 6, "num_attention_heads": 8,
           "num_key_value_heads": 2, "ffn_hidden_size": 384, "seq_length": 64, "vocab_size": 100}
    graph = tensoropt.capture(write_json("llama.json", cfg)).graph
    folded = folded_exactly(graph)
    ((name, _, repeats),) = blocks(folded)
    assert (name, repeats) == ("layers.*", 6)


def test_moe_alternating_layers_fold_as_pairs(write_json):
    cfg = {"family": "moe", "hidden_size": 64, "num_layers": 8, "num_attention_heads": 4,
           "ffn_hidden_size": 128, "seq_length": 32, "vocab_size": 100, "num_experts": 4}
    graph = tensoropt.capture(write_json("moe.json", cfg)).graph
    folded = folded_exactly(graph)
    ((name, _, repeats),) = blocks(folded)
    assert (name, repeats) == ("layers.{0,1}", 4)          # a dense layer and an MoE layer per copy


def test_wide_resnet_stages_stay_apart():
    graph = tensoropt.capture("wide-resnet50-2").graph
    folded = folded_exactly(graph)
    # each stage's first block downsamples; the others repeat with the stage's own shapes, and are named by the
    # copies they hold among the stage's blocks (``stages.0.*`` alone would find the downsampling one too)
    assert blocks(folded) == [("stages.0.*[1:3]", 16, 2), ("stages.1.*[1:4]", 16, 3), ("stages.2.*[1:6]", 16, 5),
                              ("stages.3.*[1:3]", 16, 2)]


def test_user_model_with_arbitrary_names_and_two_widths():
    graph = tensoropt.capture(f"{EXAMPLES / 'custom_model.py'}:build").graph
    folded = folded_exactly(graph)
    assert blocks(folded) == [("alpha..delta", 12, 4), ("epsilon..eta", 12, 3)]


def test_hugging_face_llama_config():
    graph = tensoropt.capture(str(EXAMPLES / "llama2-7b-hf-config.json"), seq_len=256).graph
    folded = folded_exactly(graph)
    assert graph.num_parameters == 6_738_415_616
    ((name, _, repeats),) = blocks(folded)
    assert (name, repeats) == ("model.layers.*", 32)


class Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x, skip=None):
        y = self.norm(torch.relu(self.fc(x)))
        return y + (x if skip is None else skip)


class Widths(nn.Module):
    """Same structure in every layer, but widths 32, 32, 32, 48, 48, 48."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(Layer(32) for _ in range(3))
        self.up = nn.Linear(32, 48)
        self.b = nn.ModuleList(Layer(48) for _ in range(3))

    def forward(self, x):
        for layer in self.a:
            x = layer(x)
        x = self.up(x)
        for layer in self.b:
            x = layer(x)
        return x.sum()


def _capture(module, *shapes):
    with torch.device("meta"):
        model = module()
    return trace_module(model, tuple(torch.empty(*s, device="meta") for s in shapes))


def test_same_structure_different_shapes_do_not_fold_together():
    graph = _capture(Widths, (4, 32))
    folded = folded_exactly(graph)
    shapes = [{m.shape for op in b.ops for m in op.inputs if len(m.shape) == 2 and m.shape[0] == 4}
              for b in folded.blocks]
    assert len(folded.blocks) == 2 and shapes[0] != shapes[1]


class Rewired(nn.Module):
    """Identical op sequences, but odd layers add the *stem* output instead of their own input:
    labels repeat every layer, edges only every two layers."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 32)
        self.layers = nn.ModuleList(Layer(32) for _ in range(8))

    def forward(self, x):
        stem = x = self.stem(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, stem if i % 2 else None)
        return x.sum()


def test_edges_decide_what_folds_not_only_op_kinds():
    graph = _capture(Rewired, (4, 32))
    folded = folded_exactly(graph)
    ((name, ops, repeats),) = blocks(folded)
    assert (name, ops, repeats) == ("layers.{0,1}", 2 * 4, 4)       # two 4-op layers per copy


class NoRepeats(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer(w) for w in (16, 24, 32, 40))
        self.proj = nn.ModuleList(nn.Linear(a, b) for a, b in ((16, 24), (24, 32), (32, 40)))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < 3:
                x = self.proj[i](x)
        return x.sum()


def test_nothing_repeats_nothing_folds():
    graph = _capture(NoRepeats, (4, 16))
    folded = folded_exactly(graph)
    assert folded.blocks == () and folded.ops_after_folding == len(graph.ops)


@pytest.mark.slow
@pytest.mark.parametrize("name, layers", [("gpt3-175b", 96), ("llama2-70b", 80), ("megatron-1t", 128)])
def test_large_presets_fold_to_one_block(name, layers):
    graph = tensoropt.capture(name).graph
    ((block, _, repeats),) = blocks(folded_exactly(graph))
    assert (block, repeats) == ("layers.*", layers)


class TwoStacks(nn.Module):
    """Two runs of identical layers, each stack with its own shared input (a per-stack bias
    computed once): one block structure, two different external producers."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 32)
        self.first = nn.ModuleList(Layer(32) for _ in range(3))
        self.middle = nn.Linear(32, 32)
        self.second = nn.ModuleList(Layer(32) for _ in range(3))

    def forward(self, x):
        x = self.stem(x)
        shared = torch.tanh(x)
        for layer in self.first:
            x = layer(x, shared)
        shared = torch.sigmoid(self.middle(x))
        for layer in self.second:
            x = layer(x, shared)
        return x.sum()


def test_runs_with_different_shared_inputs_unfold_exactly():
    graph = _capture(TwoStacks, (4, 32))
    folded = folded_exactly(graph)
    assert [(b.name, b.repeats) for b in folded.blocks] == [("first.*", 3), ("second.*", 3)]


class Gated(nn.Module):
    """A layer of ``Layer``'s width with other ops: the two never fold together."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x * torch.sigmoid(self.fc(x)) + x


class TwoKinds(nn.Module):
    """One list of layers of two kinds (as DeepSeek-V3's dense, then MoE layers): a gated one alone, two plain, three
    gated, two plain."""

    KINDS = "GDDGGGDD"

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Gated(32) if kind == "G" else Layer(32) for kind in self.KINDS)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_blocks_sharing_a_pattern_are_named_by_the_copies_they_hold():
    """Both blocks' copies are ``layers.*`` modules: each is named by the slices of those modules it holds, counting
    the lone layer no block holds, and the runtime finds each block's copies, and only those, by that name."""
    with torch.device("meta"):
        model = TwoKinds()
    graph = trace_module(model, (torch.empty(4, 32, device="meta"),))
    folded = folded_exactly(graph)
    assert [(b.name, b.repeats) for b in folded.blocks] == [("layers.*[1:3,6:8]", 4), ("layers.*[3:6]", 3)]
    assert [copies_of(model, b.name) for b in folded.blocks] == [[o.scope for o in b.occurrences]
                                                                for b in folded.blocks]
    assert copies_of(model, "layers.*[1:3,6:8]") == ["layers.1", "layers.2", "layers.6", "layers.7"]
    assert copies_of(model, "layers.*") == [f"layers.{i}" for i in range(8)]


def test_a_block_name_picking_copies_the_model_lacks_is_one_line():
    with torch.device("meta"):
        model = TwoKinds()
    with pytest.raises(TensorOptError, match=r"picks copy 8 of 'layers\.\*', which matches 8 modules here"):
        copies_of(model, "layers.*[3:9]")
    with pytest.raises(ValueError, match="slice 5:4 is empty or not after the one before it"):
        split_name("layers.*[0:2,5:4]")
    assert split_name("layers.[0-3]") == ("layers.[0-3]", None)      # an fnmatch class, not a slice


class OddFirst(TwoKinds):
    """A gated first layer no block holds, then one block of three plain layers (as a DeepSeek-V3 with one dense
    layer: ``first_k_dense_replace`` 1)."""

    KINDS = "GDDD"


def test_a_block_whose_pattern_also_matches_a_lone_layer_is_named_by_its_copies():
    """The block's pattern ``layers.*`` matches the lone first layer too, which the runtime would then recompute and
    shard as one of the block's copies: the block is named by the copies it holds, and finds those only."""
    with torch.device("meta"):
        model = OddFirst()
    graph = trace_module(model, (torch.empty(4, 32, device="meta"),))
    folded = folded_exactly(graph)
    assert [(b.name, b.repeats) for b in folded.blocks] == [("layers.*[1:4]", 3)]
    assert copies_of(model, folded.blocks[0].name) == ["layers.1", "layers.2", "layers.3"]


def test_copies_with_unrelated_names_are_found_by_their_range():
    """``alpha..delta``: the runtime finds a block of unrelated names as the modules from its first to its last copy,
    the copies the fold found (examples/custom_model.py)."""
    graph = tensoropt.capture(f"{EXAMPLES / 'custom_model.py'}:build").graph
    spec = importlib.util.spec_from_file_location("custom_model", EXAMPLES / "custom_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model, _ = module.build()
    for block in fold(graph).blocks:
        assert copies_of(model, block.name) == [o.scope for o in block.occurrences]
    assert copies_of(model, "alpha..delta") == ["alpha", "beta", "gamma", "delta"]


class Interloper(nn.Module):
    """Four equal layers of unrelated names with another layer between the second and the third (after a first one
    of the same kind, which reads the model's input and so folds with none)."""

    def __init__(self):
        super().__init__()
        self.pre, self.alpha, self.beta = Layer(32), Layer(32), Layer(32)
        self.other = Gated(32)
        self.gamma, self.delta = Layer(32), Layer(32)

    def forward(self, x):
        for layer in (self.pre, self.alpha, self.beta, self.other, self.gamma, self.delta):
            x = layer(x)
        return x.sum()


def test_a_range_that_would_hold_another_module_finds_no_copies():
    """``alpha..delta`` would take ``other`` for a copy: the block gets a name the runtime finds no copies by."""
    with torch.device("meta"):
        model = Interloper()
    folded = folded_exactly(trace_module(model, (torch.empty(4, 32, device="meta"),)))
    assert [(b.name, b.repeats) for b in folded.blocks] == [("alpha..delta#1", 4)]
    assert copies_of(model, "alpha..delta#1") == []
    assert copies_of(model, "alpha..delta") == ["alpha", "beta", "other", "gamma", "delta"]


def _plan(block: str, copies: int, recompute: str = "none", zero: int = 0) -> Plan:
    return Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=1, global_batch=2, zero=zero,
                blocks=(BlockPlan(block, ((LayerStrategy(recompute), copies),)),))


def test_an_engine_refuses_to_act_on_copies_it_cannot_find():
    """``layers.{0,1}`` (a copy spanning two layers) names no module: recomputing its copies, or the torch engine's
    FSDP2 units, would act on none of them, so the plan is refused in one line; run whole (DDP, no copy-wise
    strategy) it runs as priced. A name finding other modules than the plan's copies is refused too."""
    with torch.device("meta"):
        model = Rewired()
    (block,) = fold(_capture(Rewired, (4, 32))).blocks
    assert (block.name, block.repeats) == ("layers.{0,1}", 4)
    check_copies(model, _plan(block.name, 4), "torch")
    for plan, engine in ((_plan(block.name, 4, "full"), "deepspeed"), (_plan(block.name, 4, zero=3), "torch")):
        with pytest.raises(TensorOptError, match=r"block 'layers.\{0,1\}': the plan runs 4 copies of it, and its "
                                                 r"name finds 0 modules of this model: the \w+ engine acts"):
            check_copies(model, plan, engine)
    with pytest.raises(TensorOptError, match=r"runs 4 copies of it, and its name finds 8 modules of this model "
                                             r"\(layers.0, layers.1, layers.2, layers.3\)"):
        check_copies(model, _plan("layers.*", 4), "torch")
    check_copies(model, _plan("layers.*", 8, "full", zero=3), "torch")


def test_the_planner_offers_no_plan_an_engine_would_refuse_for_copies_it_cannot_find():
    """``layers.{0,1}`` finds no module: of every plan the engines run, none recomputes, shards or wraps its
    copies one by one; the planner's whole space (``engines=None``) holds such plans, each on no engine."""
    with torch.device("meta"):
        model = Rewired()
    cluster = Cluster(2, 2, load_profile("h100-80gb"))
    offered = tensoropt.plan(model, cluster, example_inputs=(torch.empty(4, 32, device="meta"),), global_batch=4,
                             fits=False)
    assert offered.points
    for point in offered.points:
        (bp,) = point.plan.blocks
        assert bp.block == "layers.{0,1}"
        assert not acts_per_copy(point.plan, bp, offered.engine_of(point))
        check_copies(model, point.plan, offered.engine_of(point))
    whole = tensoropt.plan(model, cluster, example_inputs=(torch.empty(4, 32, device="meta"),), global_batch=4,
                           fits=False, engines=None)
    # what DeepSpeed would act on copy by copy, the torch engine would too: no engine runs those
    refused = [p for p in whole.points if acts_per_copy(p.plan, p.plan.blocks[0], "deepspeed")]
    assert refused and all(whole.engine_of(p) == "" for p in refused)
