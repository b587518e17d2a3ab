"""Context parallelism in the torch engine (issue 37): each sample's sequence split over cp ranks in load-balanced
causal chunks (``runtime.parallel.context_parallel``), the built-in model computing its share
(``models.sequence``): its positions, its causal mask's rows, every key and value of the sequence gathered. Real
workers over gloo train to the losses of the script run alone (float32, rtol ``LOSS_RTOL``: each rank's attention
sums its rows over the same keys as the whole sequence's, only the loss's mean and the gradients' sums are split)."""


import pytest
import torch
from conftest import EXAMPLES
from workers import GPT_SCRIPT, LOSS_RTOL, launched_with_plan, losses_alone, probe_under_torchrun

from tensoropt.errors import TensorOptError
from tensoropt.models import sequence
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.parallel.context_parallel import chunks, shard_batch
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

LLAMA_SCRIPT = str(EXAMPLES / "train_llama_large.py")
SEQ = 256


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_chunks_cover_the_sequence_once_and_balance_the_causal_work(cp):
    spans = [chunks(SEQ, cp, rank) for rank in range(cp)]
    tokens = sorted(t for rank in spans for start, stop in rank for t in range(start, stop))
    assert tokens == list(range(SEQ))
    # under a causal mask token t attends to t + 1 keys: every rank's queries see as many keys in all
    work = {sum(t + 1 for start, stop in rank for t in range(start, stop)) for rank in spans}
    assert len(work) == 1


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_one_line():
    with pytest.raises(TensorOptError, match="a sequence of 100 tokens does not split so; use a sequence length "
                                             "divisible by 8 or another --cp"):
        chunks(100, 4, 0)


def test_shard_batch_cuts_every_sequence_and_nothing_else():
    ids, labels, weights = torch.arange(2 * 8).view(2, 8), torch.arange(2 * 8).view(2, 8) + 100, torch.ones(2)
    got = shard_batch({"input_ids": ids, "labels": labels, "weights": weights}, 8, 2, 1)
    assert got["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]      # chunks 1 and 2 of 4
    assert got["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert got["weights"] is weights
    assert shard_batch((ids, labels), 8, 2, 0)[0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]


def _config(kind: str) -> TransformerConfig:
    common = dict(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, seq_length=32,
                  vocab_size=50)
    if kind == "gpt":                         # learned positions, eager attention with the explicit causal mask
        return TransformerConfig(**common)
    return TransformerConfig(**common, num_key_value_heads=2, norm="rmsnorm", activation="swiglu", position="rope",
                             bias=False, tie_embeddings=False, attention="flash")


class _Recorded:
    """Each attention's keys and values of the whole sequence, recorded by a forward without a shard, handed out as
    the all-gather would (and each rank's own keys checked against them: its positions' rotary angles)."""

    def __init__(self, model: DecoderLM, batch) -> None:
        self.keys: list[torch.Tensor] = []
        self.calls = 0
        sequence.use_shard(sequence.SequenceShard(((0, 32),), 32, self._record))
        try:
            self.whole_loss = model(*batch)
        finally:
            sequence.use_shard(None)

    def _record(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.keys.append(x.detach())
        return x

    def gather_for(self, spans):
        positions = torch.cat([torch.arange(a, b) for a, b in spans])

        def gather(x: torch.Tensor, dim: int) -> torch.Tensor:
            whole = self.keys[self.calls % len(self.keys)]
            self.calls += 1
            torch.testing.assert_close(x, whole.index_select(dim, positions))
            return whole
        return gather


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("cp", [2, 4])
def test_each_shard_computes_its_tokens_of_the_whole_sequence(kind, cp):
    torch.manual_seed(0)
    model = DecoderLM(_config(kind)).eval()
    ids, labels = torch.randint(0, 50, (2, 32)), torch.randint(0, 50, (2, 32))
    with torch.no_grad():
        plain = model(ids, labels)
        recorded = _Recorded(model, (ids, labels))
        losses = []
        for rank in range(cp):
            spans = chunks(32, cp, rank)
            sequence.use_shard(sequence.SequenceShard(spans, 32, recorded.gather_for(spans)))
            try:
                losses.append(model(*shard_batch((ids, labels), 32, cp, rank)))
            finally:
                sequence.use_shard(None)
    torch.testing.assert_close(recorded.whole_loss, plain)          # one shard of everything: the plain forward
    # equal token counts: the mean of the ranks' mean losses is the whole sequence's (float32 sums of 64 terms)
    torch.testing.assert_close(torch.stack(losses).mean(), plain, rtol=1e-6, atol=0)


def test_a_shard_refuses_an_input_of_another_length():
    model = DecoderLM(_config("gpt"))
    sequence.use_shard(sequence.SequenceShard(chunks(32, 2, 0), 32, lambda x, dim: x))
    try:
        with pytest.raises(ValueError, match="holds 16 tokens of each 32-token sample, the model got 8"):
            model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    finally:
        sequence.use_shard(None)


def _plan(devices: int, dp: int, cp: int, zero: int, recompute: tuple[str, str], micro_batch: int, tp: int = 1,
          sp: bool = False) -> Plan:
    strategies = tuple((LayerStrategy(r, sp), 1) for r in recompute)
    return Plan(devices=devices, dp=dp, tp=tp, pp=1, micro_batch=micro_batch, global_batch=8, zero=zero, cp=cp,
                dtype="float32", master_weights=False, precision="32-true",
                tp_branches=("attn", "mlp") if tp > 1 else (), blocks=(BlockPlan("layers.*", strategies),))


GPT_ARGS = ("--layers", "2", "--seq-len", str(SEQ))
LLAMA_ARGS = ("--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "128",
              "--seq-len", str(SEQ), "--dtype", "float32", "--global-batch", "8")


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("script, args, plan", [
    # cp2 alone: DDP over the two cp ranks, the first copy recomputed (its gathers run again in the backward)
    (GPT_SCRIPT, GPT_ARGS, _plan(2, 1, 2, 0, ("full", "none"), 4)),
    # cp2 x dp2: FSDP2 ZeRO 3 over the flattened dp x cp mesh, selective recomputation (the attention core again)
    (GPT_SCRIPT, GPT_ARGS, _plan(4, 2, 2, 3, ("selective", "none"), 2)),
    # cp2 x tp2: the heads split over tp, each rank gathering its share of them over its cp rank (tp apart), FSDP2
    # ZeRO 1 over the cp ranks
    (GPT_SCRIPT, GPT_ARGS, _plan(4, 1, 2, 1, ("full", "none"), 4, tp=2)),
    # Llama-shaped: rotary positions, grouped-query SDPA with the mask rows, built on the meta device; cp4, ZeRO 2
    (LLAMA_SCRIPT, LLAMA_ARGS, _plan(4, 1, 4, 2, ("none", "full"), 2)),
    # cp2 x tp2 with sequence parallelism: each rank gathers its tp share of the kv heads over its cp ranks (stride
    # tp), the vocabulary split over tp, FSDP2 ZeRO 3 over the cp ranks
    (LLAMA_SCRIPT, LLAMA_ARGS, _plan(4, 1, 2, 3, ("none", "full"), 2, tp=2, sp=True)),
], ids=["gpt-cp2", "gpt-cp2-dp2-zero3", "gpt-cp2-tp2-zero1", "llama-cp4-zero2", "llama-cp2-tp2-sp-zero3"])
def test_context_parallel_plans_train_to_the_losses_alone(script, args, plan, tmp_path_factory, tmp_path):
    alone = losses_alone(script, tmp_path_factory.mktemp("alone") / "losses.json", *args)
    ran = launched_with_plan(plan, tmp_path, plan.devices, script, *args)
    assert ran["losses"] == pytest.approx(alone, rel=LOSS_RTOL)
    assert ran["written"]["cp"] == plan.cp


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_the_backward_keeps_each_ranks_share_of_the_gathered_keys_and_values(tmp_path):
    """One torchrun of tests/cp_shares_probe.py (cp 2, two layers, GQA): with the runtime's saved-tensor hooks autograd
    is handed the rank's share of every gathered key and value instead of the whole sequence's (under eager attention
    exactly half of K and V fewer bytes per layer; flash attention's two chunks read views of them), the backward
    gathers each once more (one all-gather per key or value and layer, as many as the forward), and every gradient is
    bitwise the one of autograd keeping the gathered tensors."""
    probe = probe_under_torchrun("cp_shares_probe.py", tmp_path)
    layers = 2
    for attention, got in probe.items():
        assert got["same_gradients"], attention
        assert got["shares"]["forward_gathers"] == got["whole"]["forward_gathers"] == 2 * layers, attention
        assert (got["shares"]["backward_gathers"], got["whole"]["backward_gathers"]) == (2 * layers, 0), attention
        assert got["shares"]["kept_bytes"] < got["whole"]["kept_bytes"], attention
    eager = probe["eager"]
    assert eager["whole"]["kept_bytes"] - eager["shares"]["kept_bytes"] == layers * eager["kv_bytes_per_layer"] // 2
