"""benchmarks/_loso.py, the leave-one-source-out validation of public_h100's fitted constants: a source's held-out
errors come from constants fitted without it, and sources named never-fitted move no fit.

Synthetic tables (no pricing): each row's error on the grid is that of a row whose true constants are known, so the
fit must find them."""

import pytest
from conftest import REPO

from tensoropt.cost.profile import load_profile


@pytest.fixture
def loso(benchmark_module):
    return benchmark_module("_loso")


def _row_table(loso, true_factor: float | None = None, true_memory: float | None = None) -> dict:
    """A compute-bound row (time scales as 1 / curve factor, exact at ``true_factor``) or a memory-bound one (as
    1 / memory efficiency, exact at ``true_memory``): the two constants cannot stand in for each other."""
    return {(f, m): (true_factor / f if true_memory is None else true_memory / m) - 1
            for f in loso.CURVE_FACTORS for m in loso.MEMORY_EFFICIENCIES}


def _rows(sources_and_profiles):
    return [{"source": s, "group": "g", "model": "m", "gpus": 8, "family": "f"} for s, _ in sources_and_profiles]


def test_each_source_is_priced_with_constants_fitted_on_the_others(loso):
    # p1's compute-bound rows: source A's true curve factor 0.8, B's and C's 1.1; D's memory-bound row, 0.7
    layout = [("A", "p1"), ("B", "p1"), ("B", "p1"), ("C", "p1"), ("D", "p1")]
    table = [_row_table(loso, true_factor=t) for t in (0.8, 1.1, 1.1, 1.1)] + [_row_table(loso, true_memory=0.7)]
    profiles = [p for _, p in layout]
    on_all, held = loso.leave_one_source_out(_rows(layout), table, profiles, ("p1", "p2"), ())
    assert on_all["curve_factors"]["p1"] == 1.1 and on_all["memory_efficiency"] == 0.7
    assert on_all["unfitted"] == ["p2"] and on_all["curve_factors"]["p2"] == 1.0
    by_source = {r["source"]: r for r in held}
    # A held out: fitted on B and C alone (1.1), so A's row comes out too fast by 0.8 / 1.1 - 1; on all sources the
    # same constants, and A's fitted error is that too (one row against three)
    assert by_source["A"]["constants"]["curve_factors"]["p1"] == 1.1
    assert by_source["A"]["held_out_error"] == pytest.approx(0.8 / 1.1 - 1)
    assert by_source["A"]["fitted_error"] == pytest.approx(0.8 / 1.1 - 1)
    # C held out: A's one row against B's two: 1.1, exact for C
    assert by_source["C"]["held_out_error"] == pytest.approx(0.0)
    # B held out: A and C pull alike; the median-like loss is least anywhere between their truths
    assert all(0.8 <= r["constants"]["curve_factors"]["p1"] <= 1.1 for r in held if r["source"] == "B")


def test_a_never_fitted_source_moves_no_fit(loso):
    layout = [("A", "p1"), ("B", "p1"), ("OWN", "p1"), ("OWN", "p1"), ("OWN", "p1")]
    profiles = [p for _, p in layout]
    fits = []
    for own_truth in (0.7, 1.2):          # the never-fitted rows as far apart as the grid goes
        table = [_row_table(loso, true_factor=t) for t in (0.9, 0.9, own_truth, own_truth, own_truth)]
        on_all, held = loso.leave_one_source_out(_rows(layout), table, profiles, ("p1",), ("OWN",))
        fits.append((on_all, [r["constants"] for r in held]))
        assert on_all["curve_factors"]["p1"] == 0.9
        own = [r for r in held if r["source"] == "OWN"]
        assert all(r["held_out_error"] == pytest.approx(own_truth / 0.9 - 1) for r in own)
    assert fits[0] == fits[1]


def test_a_source_that_would_set_the_fit_is_priced_without_it(loso):
    # X's three rows outvote Y's two on all sources (0.8); held out, X meets Y's constants (1.1)
    layout = [("X", "p1")] * 3 + [("Y", "p1")] * 2
    table = [_row_table(loso, true_factor=t) for t in (0.8, 0.8, 0.8, 1.1, 1.1)]
    on_all, held = loso.leave_one_source_out(_rows(layout), table, ["p1"] * 5, ("p1",), ())
    assert on_all["curve_factors"]["p1"] == 0.8
    x = [r for r in held if r["source"] == "X"]
    assert [r["fitted_error"] for r in x] == pytest.approx([0.0] * 3)
    assert [r["held_out_error"] for r in x] == pytest.approx([0.8 / 1.1 - 1] * 3)


def test_a_row_on_a_profile_no_fit_is_given_is_priced_on_it_as_committed(loso):
    # Z runs on p2, which the fits are not given: its far-off rows move no fit, and its error is the committed one
    layout = [("A", "p1"), ("A", "p1"), ("Z", "p2"), ("Z", "p2")]
    table = [_row_table(loso, true_factor=t) for t in (0.9, 0.9, 0.7, 0.7)]
    for row in table[2:]:
        row["committed"] = -0.25
    on_all, held = loso.leave_one_source_out(_rows(layout), table, ["p1", "p1", "p2", "p2"], ("p1",), ())
    assert on_all["curve_factors"] == {"p1": 0.9}
    z = [r for r in held if r["source"] == "Z"]
    assert [r["held_out_error"] for r in z] == [-0.25, -0.25]


def test_rows_on_unfitted_profiles_are_priced_as_committed_only(loso):
    profiles = {name: load_profile(str(REPO / "profiles" / f"{name}.json")) for name in ("h100-80gb", "h200-141gb")}
    seen = []

    def priced(row, profile):
        seen.append((row["id"], profile.name))
        return 0.0
    rows = [{"id": "fitted", "profile": "h100-80gb"}, {"id": "unfitted", "profile": "h200-141gb"}]
    table = loso.error_table(rows, priced, profiles, lambda r: r["profile"], ("h100-80gb",))
    grid = len(loso.CURVE_FACTORS) * len(loso.MEMORY_EFFICIENCIES)
    assert len(table[0]) == grid + 1 and set(table[1]) == {"committed"}
    assert seen.count(("unfitted", "h200-141gb")) == 1 and len(seen) == grid + 2
