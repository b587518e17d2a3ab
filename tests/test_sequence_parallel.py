"""Sequence parallelism in the torch engine (``runtime.parallel.sequence_parallel``): which blocks the planner offers it
to, and real torchrun runs over gloo on CPU, compared with the same script run alone (float32, rtol 2e-5)."""

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from conftest import EXAMPLES
from torch import nn
from workers import LOSS_RTOL, dry_run_plan, launched_with_plan, losses_alone, probe_under_torchrun, tp2

import tensoropt
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.search.engines import ENGINE_SPACES, unsupported
from tensoropt.search.ft import SearchSpace, layer_options
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

GPT, LLAMA = str(EXAMPLES / "train_gpt.py"), str(EXAMPLES / "train_llama_hf.py")
BATCH, SEQ, HIDDEN = 2, 32, 64       # as in tests/sp_block_probe.py


def _block_cost(model: nn.Module, seq: int = SEQ):
    ids = torch.zeros(1, seq, dtype=torch.long)
    graph = tensoropt.capture(model, (ids, ids), cache=False).graph
    [(_, cost)] = ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb"))).blocks
    return cost


def _gpt_graph():
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    return tensoropt.capture(_gpt(), (ids, ids), cache=False).graph


def _gpt(attention: str = "flash", seq: int = SEQ) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(hidden_size=HIDDEN, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
                                       seq_length=seq, vocab_size=128, attention=attention))


class _RunningMean(nn.Module):
    """A block whose stream, outside its MLP branch, averages over the positions so far."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 128), nn.Linear(128, HIDDEN)

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(self.norm(x))))
        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)


class _RunningMeanLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layers, self.head = nn.Embedding(128, HIDDEN), nn.ModuleList(
            _RunningMean() for _ in range(2)), nn.Linear(HIDDEN, 128)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_the_planner_offers_sequence_parallelism_where_the_stream_is_per_token_and_tp_divides_the_sequence():
    torch_space = SearchSpace(8, **ENGINE_SPACES["torch"])
    gpt = _block_cost(_gpt())
    assert gpt.space.sequence_refused == "" and gpt.space.sp_allowed(2)
    assert LayerStrategy("none", True) in layer_options(gpt, 2, torch_space)
    assert not any(s.sequence_parallel for s in layer_options(gpt, 1, torch_space))
    odd = _block_cost(_gpt(seq=30), seq=30)
    assert odd.space.sp_allowed(2) and not odd.space.sp_allowed(4)      # 4 does not divide 30 positions
    mixing = _block_cost(_RunningMeanLM())
    assert mixing.space.branches and "aten.cumsum" in mixing.space.sequence_refused
    assert not any(s.sequence_parallel for s in layer_options(mixing, 2, torch_space))


def test_a_gpt_layer_is_priced_korthikantis_activations_plus_the_norms_statistics():
    """Korthikanti et al. 2022 (eq. 2-5; DESIGN.md's reference footprints), per GPT layer with eager attention,
    dropout and 16-bit activations at tp t: ``s b h (10 + 24/t + 5 a s / (h t))`` bytes with tensor parallelism,
    ``s b h (34 + 5 a s / h) / t`` with SP, ``34 s b h / t`` with SP and selective recomputation (the core dropped,
    the column-parallel inputs kept as the rank's share). The cost model prices exactly these plus what the paper
    leaves out (``cost.layer``'s doc): each LayerNorm's mean and reciprocal standard deviation, two bf16 values per
    token for each of the two norms, divided by t under SP."""
    h, a, s, b, t = HIDDEN, 4, SEQ, BATCH, 2
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(hidden_size=h, num_layers=2, num_attention_heads=a, ffn_hidden_size=4 * h,
                                        seq_length=s, vocab_size=128, dropout=0.1, attention="eager"))
    cost = _block_cost(model.to(torch.bfloat16))
    kept = {(r, sp): cost.layer(LayerStrategy(r, sp), t, ("attn", "mlp"), b).activation_bytes
            for r, sp in (("none", False), ("none", True), ("selective", True))}
    statistics = 2 * 2 * s * b * 2
    assert kept["none", False] == s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) + statistics
    assert kept["none", True] == s * b * h * (34 + 5 * a * s / h) / t + statistics / t
    assert kept["selective", True] == 34 * s * b * h / t + statistics / t


def test_a_sharded_copy_holds_its_row_linears_biases_whole():
    """``RowwiseParallel`` splits a row linear's weight and keeps its bias whole (it is added once, after the sum):
    a tp2 copy of the GPT block holds half of each linear's weight, half the column biases, the whole row biases
    and norms."""
    h, ffn = HIDDEN, 256
    expected = (3 * h * h + 3 * h) / 2 + h * h / 2 + h + (ffn * h + ffn) / 2 + h * ffn / 2 + h + 4 * h
    assert _block_cost(_gpt()).layer(LayerStrategy("none", True), 2, ("attn", "mlp"), 1).parameters == expected


def test_a_plan_running_a_position_mixing_stream_sequence_parallel_does_not_fit_the_model():
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    graph = tensoropt.capture(_RunningMeanLM(), (ids, ids), cache=False).graph
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb")))
    [(block, _)] = model.blocks
    plan = Plan(devices=2, dp=1, tp=2, pp=1, micro_batch=1, global_batch=2, tp_branches=model.branch_names,
                dtype="float32", blocks=(BlockPlan(block.name, ((LayerStrategy("none", True), 2),)),))
    with pytest.raises(ValueError, match="sequence parallelism cannot split the stream of block 'layers.*'.*cumsum"):
        estimate(model, plan)
    estimate(model, dataclasses.replace(plan, blocks=(BlockPlan(block.name, ((LayerStrategy("none"), 2),)),)))


def test_torch_runs_sequence_parallel_plans_and_deepspeed_refuses_them():
    plan = Plan(devices=2, dp=1, tp=2, pp=1, micro_batch=1, global_batch=1,
                blocks=(BlockPlan("layers.*", ((LayerStrategy("none", True), 4),)),))
    assert unsupported(plan, "torch") == []
    assert "sequence parallelism" in unsupported(plan, "deepspeed")


def _launch(script, plan: Plan, tmp_path, *script_args) -> dict:
    """``tensoropt launch --plan`` for 3 steps: rank 0's output (and the plan.json the workers got)."""
    data = launched_with_plan(plan, tmp_path, plan.devices, script, *script_args)
    assert "sequence parallel in" in data["stdout"]
    return data


def _with(plan: Plan, *strategies: tuple[str, bool, int], **changes) -> Plan:
    (block,) = plan.blocks
    chain = tuple((LayerStrategy(r, sp), n) for r, sp, n in strategies)
    return dataclasses.replace(plan, blocks=(BlockPlan(block.block, chain),), **changes)


def test_a_saved_gathered_input_is_kept_as_its_own_share_on_fake_tensors_too():
    """Each gathered input autograd saves is found, by storage, as the share it was gathered from. Fake tensors (the
    memory simulation's) all have data pointer 0: compared by pointer, the MLP's gathered input was packed as the
    attention's share, so the simulated step held one share per copy less than a real run."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from tensoropt.runtime.parallel.sequence_parallel import _GatherOnce
    for mode in (FakeTensorMode(), contextlib.nullcontext()):
        with mode:
            attn_share, mlp_share = torch.empty(1, 4, 8), torch.empty(1, 4, 8)
            attn_whole, mlp_whole = torch.empty(1, 8, 8), torch.empty(1, 8, 8)
            gathers = _GatherOnce(mesh=None)
            gathers.done = {1: (attn_share, SimpleNamespace(_local_tensor=attn_whole)),
                            2: (mlp_share, SimpleNamespace(_local_tensor=mlp_whole))}
            found = [gathers.share_of(t) for t in (attn_whole, mlp_whole, mlp_whole.view(8, 8),
                                                   torch.empty(1, 8, 8))]
        assert found[0] is attn_share and found[1] is mlp_share
        assert found[2] is mlp_share                                             # a contiguous view of it
        assert found[3] is None                                                  # another tensor of its size


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_one_block_copy_sequence_parallel_computes_the_whole_copy_and_keeps_a_share_of_the_stream(tmp_path):
    """One torchrun of tests/sp_block_probe.py: outputs and every gradient of an SP copy (both branches sharded,
    or attention replicated; no, full and selective recomputation; fused and eager attention) equal the whole
    copy's, and bitwise those of the same SP copy keeping its gathered inputs whole (as recomputed SP copies did
    before their hooks composed with the recomputation's); the activations an SP copy keeps, without recomputation,
    selectively and fully recomputed, and what a full recomputation holds in the backward, are what the cost model
    prices (which also counts the copy's output, kept by the next copy: whole under tensor parallelism, a share
    under SP); a block that averages over the sequence outside its branches is stopped by the check before
    training."""
    probe = probe_under_torchrun("sp_block_probe.py", tmp_path)
    assert len(probe["max_difference"]) == 12
    assert all(d < 1e-5 for d in probe["max_difference"].values()), probe["max_difference"]
    assert probe["equal_to_keeping_whole"] == {k: True for k in probe["max_difference"]}
    output_bytes = BATCH * SEQ * HIDDEN * 4
    for attention, kept in probe["kept_bytes"].items():
        cost = _block_cost(_gpt(attention))
        priced = {(r, sp): cost.layer(LayerStrategy(r, sp), 2, ("attn", "mlp"), BATCH)
                  for r in ("none", "selective", "full") for sp in (False, True)}
        tp = priced["none", False].activation_bytes
        assert kept["tp"] == tp - output_bytes
        assert kept["none"] == priced["none", True].activation_bytes - output_bytes / 2 < kept["tp"]
        assert kept["selective_wrapper"] == priced["selective", True].activation_bytes - output_bytes / 2
        assert kept["checkpoint_wrapper"] == priced["full", True].activation_bytes - output_bytes / 2 == 0
        assert kept["recomputed"] == priced["full", True].transient_bytes - output_bytes / 2 == kept["none"]
    # the eager copy's core (softmax probabilities) is dropped; the fused one has none
    assert probe["kept_bytes"]["eager"]["selective_wrapper"] < probe["kept_bytes"]["eager"]["none"]
    assert probe["kept_bytes"]["flash"]["selective_wrapper"] == probe["kept_bytes"]["flash"]["none"]
    assert probe["refused"].startswith("sequence parallelism over 2 devices changes what mixes.0 computes")
    # the norms' gradients, partial sums over tp: one all-reduce a step for all of them, where DTensor alone
    # all-reduces each where AdamW reads it (three times); the same parameters after two steps, bitwise
    collectives = probe["optimizer_collectives"]
    assert collectives["partial_gradients"] == 3 * 4                     # 2 norms' weights and biases a copy
    assert collectives["engine"] == {"c10d.allreduce_": 1}
    assert collectives["plain"] == {"c10d_functional.all_reduce": 3 * collectives["partial_gradients"]}
    assert collectives["same_parameters"]
    # the layout copies made along the sequence (dim 1 of our batch-first stream), counted in one SP copy's forward
    # and backward: torch's functional collectives, which would move shares between dim 0 and dim 1, never run. The
    # eager copy gathers every sample on views of one buffer (the backward's gathers again of kept shares too) and
    # reduce-scatters on a view at batch 1 and on the chunks concatenated rank by rank past it: per sharded branch
    # two concatenations of the whole stream (the forward's reduce-scatter, the backward's of the input's gather), the
    # copies priced (``BlockCost.sp_copies_s``, issue 35). Compiled blocks trace torch's redistribution: its copies
    cost = _block_cost(_gpt())
    whole = {1: SEQ * HIDDEN * 4, BATCH: BATCH * SEQ * HIDDEN * 4}
    assert probe["layout_copies"] == {"1": {}, str(BATCH): {f"concatenate copy {whole[BATCH]}": 4}}, \
        probe["layout_copies"]
    one = 2 * whole[BATCH] / cost.cluster.profile.copy_bytes_per_s + cost.cluster.profile.kernel_overhead_s
    assert sum(cost.sp_copies_s(2, ("attn", "mlp"), BATCH)) == pytest.approx(4 * one, rel=1e-9)
    assert sum(cost.sp_copies_s(2, ("attn", "mlp"), 1)) == 0.0
    graph = _gpt_graph()
    compiled = ModelCost(graph, tensoropt.fold(graph), cost.cluster, compiled=True).blocks[0][1]
    for batch, copies in ((1, 4), (BATCH, 10)):
        one = 2 * whole[batch] / cost.cluster.profile.copy_bytes_per_s + cost.cluster.profile.kernel_overhead_s
        assert sum(compiled.sp_copies_s(2, ("attn", "mlp"), batch)) == pytest.approx(copies * one, rel=1e-9)
    # and the per-sample collectives compute what the whole copy does, bitwise what torch's redistribution computes
    for batch, in_place in probe["in_place"].items():
        assert in_place["max_difference"] < 1e-5 and in_place["bitwise_torchs_path"], (batch, in_place)
    # without sequence parallelism the forward sums each branch's output in place and the backward each branch's input
    # gradient (``tp_styles._CopyToRanks``, Megatron-LM's way): four in-place all-reduces of the whole stream, no
    # functional one (which would clone: torch's ``ColwiseParallel`` did in the backward), none priced
    # (``BlockCost.reduce_copies_s``); the input's gradient is the whole block's up to float32 rounding over its
    # features' partial sums
    reduced = probe["reduce_copies"]
    assert reduced["collectives"] == {f"c10d all_reduce {whole[BATCH]}": 4}, reduced
    assert reduced["grad_difference"] <= 1e-5 * reduced["grad_scale"], reduced
    assert cost.reduce_copies_s(2, ("attn", "mlp"), BATCH) == 0.0


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_gpt_tp2_sequence_parallel_matches_one_process(tmp_path):
    """Every copy SP (the first fully recomputed, the second selectively: the eager attention's core dropped, both
    keeping their gathered inputs as shares through the recomputations' hooks), at micro-batch 4 and 1 (the
    collectives on views), then a chain mixing replicated and SP copies with attention left replicated (gathered
    whole inside the SP copies)."""
    alone = losses_alone(GPT, tmp_path / "alone.json")
    (tmp_path / "dry").mkdir()
    base = tp2(dry_run_plan(GPT, tmp_path / "dry"), ("attn", "mlp"), micro_batch=4)
    every = _with(base, ("full", True, 1), ("selective", True, 1), ("none", True, 2))
    np.testing.assert_allclose(_launch(GPT, every, tmp_path)["losses"], alone, rtol=LOSS_RTOL)
    # at micro-batch 1 the copies gather and reduce-scatter on views (runtime.parallel.sequence_collectives)
    np.testing.assert_allclose(_launch(GPT, dataclasses.replace(every, micro_batch=1), tmp_path)["losses"], alone,
                               rtol=LOSS_RTOL)
    mixed = _with(base, ("none", False, 2), ("full", True, 1), ("none", True, 1), tp_branches=("mlp",))
    np.testing.assert_allclose(_launch(GPT, mixed, tmp_path)["losses"], alone, rtol=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_hugging_face_llama_tp2_mixed_sequence_parallel_matches_one_process(tmp_path):
    """Separate q/k/v (one gather for the three) and gate/up projections, RMSNorm weights as replicated DTensors.
    Grouped-query attention (4 query heads on 2 key/value heads: each rank runs 2 query heads on its one key/value
    head), in the tensor-parallel copy first and the SP copies after it: this run was also
    tests/test_tensor_parallel.py's LLaMA GQA case."""
    alone = losses_alone(LLAMA, tmp_path / "alone.json")
    (tmp_path / "dry").mkdir()
    base = tp2(dry_run_plan(LLAMA, tmp_path / "dry"), ("self_attn", "mlp"), micro_batch=4)
    plan = _with(base, ("none", False, 1), ("full", True, 1), ("none", True, 2))
    launched = _launch(LLAMA, plan, tmp_path)
    assert "tensor parallel 2" in launched["stdout"] and launched["written"]["tp_layout"]
    np.testing.assert_allclose(launched["losses"], alone, rtol=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_gpt_tp2_sequence_parallel_with_fsdp2_over_dp2_matches_one_process(tmp_path):
    """4 workers: FSDP2 (ZeRO 3) over dp reduces the norms' gradients, partial over the sequence shares, on the
    tensor-parallel axis too; foreach AdamW over DTensors of both meshes. The first copy runs tensor-parallel
    without SP, and the vocabulary-split embedding and head are sharded by FSDP2 too: this one run is also
    tensor parallelism with FSDP2 over dp2 (it replaced such runs in tests/test_tensor_parallel.py and
    tests/test_vocab_parallel.py). The last two copies are SP and fully recomputed after an SP copy (in chain order,
    as the planner lists them; LLaMA-2 70B's [65xnone+sp,15xfull+sp]): under FSDP2 their recomputation re-enters
    with an input the stream check once refused."""
    alone = losses_alone(GPT, tmp_path / "alone.json", "--foreach")
    (tmp_path / "dry").mkdir()
    base = tp2(dry_run_plan(GPT, tmp_path / "dry", devices=4), ("attn", "mlp"), micro_batch=2)
    plan = _with(base, ("full", False, 1), ("none", True, 1), ("full", True, 2), dp=2, zero=3)
    launched = _launch(GPT, plan, tmp_path, "--foreach")
    assert "tensor parallel 2" in launched["stdout"] and launched["written"]["vocab_parallel"]["enabled"]
    np.testing.assert_allclose(launched["losses"], alone, rtol=LOSS_RTOL)
