"""The bounds that let the search drop contexts (search.bounds) are bounds: no plan of a context lies below them.

The search's own tests check that bounding keeps the frontier on whole models (tests/test_search.py); these check
the two facts it rests on, on many random cases, so that a wrong bound fails here even where no preset shows it."""

import itertools

import numpy as np
import pytest

from tensoropt.cost.data_parallel import data_parallel_s
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.search.bounds import _corners


def _mixes(strategies: int, copies: int):
    """Every multiset of ``copies`` strategies, as counts per strategy."""
    for chosen in itertools.combinations_with_replacement(range(strategies), copies):
        yield np.bincount(chosen, minlength=strategies)


@pytest.mark.parametrize("seed", range(40))
def test_every_mix_of_strategies_lies_at_or_above_a_corner(seed):
    """A mix's (time, activations) is k times a convex combination of the one-strategy points: it is no faster than
    some corner's time and no leaner than the same corner's activations."""
    rng = np.random.default_rng(seed)
    strategies, copies = int(rng.integers(1, 7)), int(rng.integers(1, 7))
    time_s, acts = rng.random(strategies), rng.random(strategies)
    if seed % 4 == 0:
        acts[rng.integers(strategies)] = acts.max()          # ties
    corners = np.array([[copies * time_s[i], copies * acts[j]] for i, j in _corners(time_s, acts)])
    for counts in _mixes(strategies, copies):
        mix = np.array([counts @ time_s, counts @ acts])
        slack = 1e-12 * np.abs(mix)                          # the sums' rounding, a few ulps
        assert ((mix + slack >= corners).all(axis=1)).any(), (counts, mix, corners)


def test_a_strategy_below_the_fast_lean_segment_is_a_vertex_and_one_above_it_is_not():
    time_s = np.array([1.0, 1.2, 2.0])                # none, selective, full recomputation (say)
    below = np.array([10.0, 3.0, 1.0])                # (1.2, 3) is under the line from (1, 10) to (2, 1)
    above = np.array([10.0, 9.0, 1.0])                # (1.2, 9) is over it (the line passes 8.2 there)
    assert _corners(time_s, below) == [(0, 1), (1, 2)]
    assert _corners(time_s, above) == [(0, 2)]        # the ideal point: fastest time, least activations
    assert _corners(np.array([1.0, np.inf]), np.array([5.0, 0.0])) == [(0, 0)]   # one strategy allowed


@pytest.mark.parametrize("profile", ["h100-80gb", "a100-80gb"])
def test_exposed_data_parallel_time_falls_with_compute_and_grows_with_bytes(profile):
    """``search.bounds`` prices a context's exposed communication at its most compute and least parameters: sound
    only if the exposed part never grows with the forward or backward it hides behind, nor falls with the bytes."""
    rng = np.random.default_rng(0)
    n = 4000
    cluster = Cluster(512, 8, load_profile(profile))
    dp = rng.choice([1, 2, 4, 16, 64], n)
    tp = rng.choice([1, 2, 8], n)
    zero, m, units = rng.integers(0, 4, n), rng.integers(1, 9, n), rng.integers(2, 40, n)
    weight, grad = rng.random(n) * 1e10, rng.random(n) * 1e10
    back = rng.random(n) * 2.0
    stage = back + rng.random(n) * 2.0
    serial = rng.random(n) < 0.3

    def exposed(weight_bytes, grad_bytes, stage_s, backward_s):
        return data_parallel_s(dp, tp, zero, m, weight_bytes, grad_bytes, stage_s, backward_s, cluster, units,
                               serial=serial)[1]
    base = exposed(weight, grad, stage, back)
    more_forward = rng.random(n)
    more_backward = rng.random(n)
    slack = 1e-12 * np.maximum(base, 1e-30)
    assert (exposed(weight, grad, stage + more_forward + more_backward, back + more_backward) <= base + slack).all()
    assert (exposed(weight * 1.5, grad * 1.5, stage, back) >= base - slack).all()
    assert (base >= 0).all() and (base > 0).any()
