"""benchmarks/public_h100.py prices a published row as it ran: a row that says its tensor parallelism ran without
sequence parallelism and with the vocabulary whole on every rank (KempnerForge under pipelining) is priced so, and
differently from the layout torchtitan and Megatron run (norms sequence-parallel, vocabulary split); and the data file
it reads adds up."""

import collections
import json
import re

import pytest
from conftest import REPO

from tensoropt.cost.comm import all_gather_s
from tensoropt.cost.model import ModelCost
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.cost.tp_copies import copy_s


def _row(sequence_parallel: bool, vocab_parallel: bool) -> dict:
    """A small Llama-shaped FSDP + TP + PP row in the data file's layout (a large vocabulary, so its ops weigh)."""
    return {
        "source": "kempnerforge_config_validation", "group": "synthetic", "repository": "r", "gpu": "NVIDIA H200",
        "model": {"name": "small", "id": "small_llama", "hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2,
                  "ffn": 768, "vocab": 32768, "arch": "llama", "norm": "rmsnorm", "activation": "swiglu",
                  "position": "rope", "bias": False, "tied_embeddings": False},
        "gpus": 16, "gpus_per_node": 4, "seq_len": 512, "micro_batch": 2, "local_batch": 2, "global_batch": 16,
        "gradient_accumulation": 4, "recompute": "full", "zero": 3, "compile": False, "engine": "torch",
        "dtype": "bf16", "parallelism": {"dp": 2, "fsdp": 2, "tp": 4, "pp": 2, "cp": 1,
                                         "sequence_parallel": sequence_parallel, "vocab_parallel": vocab_parallel},
        "derived": {"step_time_s": 1.0}, "measured": {},
    }


@pytest.fixture
def priced(benchmark_module):
    public = benchmark_module("public_h100")
    profile = load_profile(str(REPO / "profiles" / "h200-141gb.json"))
    return lambda sp, vocab: public.price(_row(sp, vocab), profile)


def test_a_row_without_sequence_parallelism_is_priced_without_it(priced):
    with_sp, without = priced(True, True), priced(False, True)
    assert "+sp" in with_sp["plan"] and "+sp" not in without["plan"]
    # norms and residual adds on the whole sequence on every rank, not a quarter of it
    assert without["breakdown"]["forward_backward_s"] > with_sp["breakdown"]["forward_backward_s"]


def test_a_row_with_its_vocabulary_replicated_prices_the_vocabulary_whole(priced):
    split, whole = priced(False, True), priced(False, False)
    assert "vocab replicated" in whole["plan"] and "vocab replicated" not in split["plan"]
    # the blocks are the same plan: what differs is the ops outside them (embedding, head, loss) on the slower end
    # stage, each micro-batch and each bubble slot
    assert whole["breakdown"]["forward_backward_s"] == split["breakdown"]["forward_backward_s"]
    assert whole["breakdown"]["compute_s"] > split["breakdown"]["compute_s"]
    assert whole["predicted_step_s"] > split["predicted_step_s"]


def test_a_row_that_gathered_its_logits_pays_their_gather_and_a_whole_loss(benchmark_module):
    """KempnerForge's TP without a pipeline gathers the logits whole on every rank for its loss: priced on top of the
    vocabulary-parallel plan, per micro-batch at least the logits' all-gather and their concatenation (a copy of the
    whole), and at most that plus the loss's ops whole (what a rank computed beyond its 1/tp of them)."""
    public = benchmark_module("public_h100")
    profile = load_profile(str(REPO / "profiles" / "h200-141gb-4gpu.json"))
    row = _row(True, True) | {"gpus": 4, "gradient_accumulation": 4, "global_batch": 8}
    row["parallelism"] = row["parallelism"] | {"dp": 1, "fsdp": 1, "pp": 1}
    plain = public.price(row, profile)
    gathered = public.price(row | {"parallelism": row["parallelism"] | {"logits_gathered": True}}, profile)
    extra = gathered["predicted_step_s"] - plain["predicted_step_s"]       # (the breakdown rounds it to 0.1 ms)
    assert extra == pytest.approx(gathered["breakdown"]["gathered_logits_s"], abs=5e-5)
    assert "gathered_logits_s" not in plain["breakdown"]
    logits = 2 * 512 * 32768 * 2                       # a micro-batch's bf16 logits: 2 samples x 512 tokens x vocab
    graph, folding, facts = public.graph_of(row)
    cluster = Cluster(4, 4, profile)
    floor = all_gather_s(logits, 4, 1, cluster) + copy_s(logits, profile)
    model = ModelCost(graph, folding, cluster, facts=facts)
    whole_loss = model.loose(1, 2, 2)[1].time_s     # the ops after the blocks (head and loss) on one rank, whole
    assert 4 * floor < extra < 4 * (floor + whole_loss)


def test_every_public_row_names_its_commit_and_adds_up():
    """The committed calibration data as the benchmark reads it: every public row names its source (listed, with its
    row count) and the full commit it was read at; its mesh multiplies to its GPUs; and where it states gradient
    accumulation, micro-batch x accumulation x data-parallel ranks is its global batch (a transcription slip in any
    of these would price another run than the one measured)."""
    data = json.loads((REPO / "benchmarks" / "data" / "public_h100.json").read_text())
    sources = {s["id"]: s for s in data["sources"]}
    counts = collections.Counter(r["source"] for r in data["rows"])
    assert all(s.get("row_count") in (None, counts[name]) for name, s in sources.items())
    for row in data["rows"]:
        assert row["source"] in sources
        if row["source"] != "tensoropt_issue12_h100":          # our own runs name this repository's commit
            assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), row["group"]
        p = row["parallelism"]
        assert (p["dp"] or 1) * (p["tp"] or 1) * (p["pp"] or 1) * (p.get("cp") or 1) == row["gpus"], row["group"]
        if row.get("gradient_accumulation") and row.get("engine") in ("torch", "deepspeed"):
            micro = row.get("local_batch") or row["micro_batch"]
            assert micro * row["gradient_accumulation"] * (p["dp"] or 1) == row["global_batch"], row["group"]
