"""The search's shortcuts price exactly as direct pricing does: plans priced together (evaluate_rows)
equal each plan priced alone (evaluate), cached layer costs equal freshly computed ones, and Pareto
sets kept together (ParetoSets) equal each set kept alone. Equal means the same floats, not close."""

import itertools

import numpy as np
import pytest

import tensoropt
from tensoropt.cost.context import ContextTable
from tensoropt.cost.layer import BlockCost
from tensoropt.cost.model import Context, ModelCost, evaluate, evaluate_rows
from tensoropt.cost.profile import PROFILES_DIR, Cluster, load_profile
from tensoropt.search.ft import SearchSpace, layer_options
from tensoropt.search.pareto import ParetoSets, combine_all, combine_sets, prune, union, union_sets

GPT = {"family": "gpt", "hidden_size": 64, "num_layers": 8, "num_attention_heads": 4,
       "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 256}


def _model(write_json, devices, per_node, profile):
    graph = tensoropt.capture(write_json("m.json", GPT)).graph
    return ModelCost(graph, tensoropt.fold(graph), Cluster(devices, per_node, load_profile(profile)))


@pytest.mark.parametrize("profile", ["h100-80gb", str(PROFILES_DIR / "cpu-2core.json")])
def test_plans_priced_together_equal_each_priced_alone(write_json, profile):
    """Every mesh, micro-batch, ZeRO stage, offload, interleaving and dtype in one evaluate_rows call."""
    model = _model(write_json, 16, 4, profile)
    rng = np.random.default_rng(0)
    ctxs = [Context(16 // (tp * pp), tp, pp, v, mb, 64, z, off, ("attn", "mlp")[:tp], dtype)
            for tp, pp, mb, dtype in itertools.product((1, 2, 4), (1, 2, 4), (1, 2), ("bfloat16", "float32"))
            for v in ((1, 2) if pp > 1 else (1,)) for z in ((0, 1) if pp > 1 else (0, 1, 2, 3))
            for off in ((False, True) if z else (False,)) if 64 % (16 // (tp * pp) * mb) == 0]
    which = np.repeat(np.arange(len(ctxs)), 3)
    sums = [rng.uniform(0.1, 2.0, len(which)), rng.uniform(0.05, 1.0, len(which)), rng.uniform(1e6, 1e9, len(which)),
            rng.choice([0.0, 3e6, 7e7], len(which)), rng.uniform(1e5, 1e8, len(which))]
    together = evaluate_rows(model, ctxs, which, *sums)
    assert len({(c.dp, c.tp, c.pp, c.zero, c.offload, c.virtual_stages, c.dtype) for c in ctxs}) > 50
    for i, c in enumerate(which):
        alone = evaluate(model, ctxs[c], *[s[i:i + 1] for s in sums])
        assert {k: v[0] for k, v in alone.items()} == {k: v[i] for k, v in together.items()}, ctxs[c]
    # the search's totals are the same numbers
    totals = evaluate_rows(model, ctxs, which, *sums, totals_only=True)
    assert all(np.array_equal(totals[k], together[k]) for k in totals)
    # the search's columns (cost.context.ContextTable) hold every context, and the rows asked in any order and
    # repeated price as they do in the list's order
    table = ContextTable.of(ctxs)
    assert [table.context(i) for i in range(len(table))] == ctxs
    shuffled = rng.permutation(len(which))
    again = evaluate_rows(model, table, which[shuffled], *[s[shuffled] for s in sums])
    assert all(np.array_equal(again[k], together[k][shuffled]) for k in again)


def test_cached_layer_costs_equal_fresh_ones(write_json):
    """A block cost that priced every strategy (sharing the per-op work between recomputation
    choices) gives each one exactly what a fresh block cost computes for it alone."""
    model = _model(write_json, 8, 8, "a100-80gb")
    block, warm = model.blocks[0]
    space = SearchSpace(global_batch=32)
    keys = [(o, tp, branches, mb) for tp in (1, 2, 4) for o in layer_options(warm, tp, space)
            for branches in ([()] if tp == 1 else [("attn", "mlp"), ("attn",), ("mlp",)]) for mb in (1, 2, 4)]
    for key in keys:
        warm.layer(*key)
    for key in keys:
        fresh = BlockCost(warm.ops, warm.space, model.cluster)
        assert fresh.layer(*key) == warm.layer(*key), key
    assert model.loose(2, 4, 2) == model.loose(2, 4, 8)          # loose ops: only whether pipelined matters


def _random_sets(rng, groups, columns=4):
    values, counts, group = [], [], []
    for g in range(groups):
        n = int(rng.integers(1, 12))
        v = rng.integers(1, 6, (n, 3)).astype(float) * np.array([1.0, 1e9, 1e8])
        v[:, 2] = rng.choice([0.0, 1e8, 3e8], n)
        values.append(v * (1 + rng.choice([0, 1e-4, 5e-3], (n, 3))))
        counts.append(rng.integers(0, 4, (n, columns)))
        group.append(np.full(n, g))
    values, counts, group = np.concatenate(values), np.concatenate(counts), np.concatenate(group)
    return ParetoSets(values, counts, group, groups)


@pytest.mark.parametrize("eps", [0.0, 0.002, 0.02])
def test_sets_kept_together_equal_each_kept_alone(eps):
    rng = np.random.default_rng(1)
    for _ in range(20):
        a, b, c = (_random_sets(rng, 5) for _ in range(3))
        pairs = [(a, b), (c, c), (b, a)]                       # (c, c): a set summed with itself
        together = combine_sets(pairs, eps)
        merged = union_sets([a, b], eps)
        for g in range(5):
            alone = combine_all([(x.set(g), y.set(g)) for x, y in pairs], eps)
            assert np.array_equal(together.set(g).values, alone.values)
            assert np.array_equal(together.set(g).counts, alone.counts)
            one = union([a.set(g), b.set(g)], eps)
            assert np.array_equal(merged.set(g).values, one.values) and np.array_equal(merged.set(g).counts,
                                                                                       one.counts)
        kept = ParetoSets.of(a.values, a.counts, a.group, 5, eps)
        for g in range(5):
            alone = prune(a.set(g).values, a.set(g).counts, eps)
            assert np.array_equal(kept.set(g).values, alone.values)
            assert np.array_equal(kept.set(g).counts, alone.counts)

