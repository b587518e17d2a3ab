"""benchmarks/search_speed.py's guard: a search made 1.4x slower fails ``--check``'s comparison (tolerance 1.3x on
the ratio to the machine-speed reference)."""

import sys
import time

import pytest

from tensoropt.cost.model import ModelCost

BENCHMARKS = __import__("pathlib").Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def search_speed(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import search_speed
    yield search_speed
    sys.modules.pop("search_speed", None)


def _slower(work, factor):
    """``work`` made ``factor`` times slower: after each call, busy-wait (factor - 1) times what the call took."""
    def slow(*args, **kwargs):
        start = time.perf_counter()
        result = work(*args, **kwargs)
        until = time.perf_counter() + (factor - 1) * (time.perf_counter() - start)
        while time.perf_counter() < until:
            pass
        return result
    return slow


def test_check_fails_for_a_search_made_1_4x_slower(search_speed, monkeypatch, tmp_path):
    """The search as committed and a copy 1.4x slower in everything ``search_seconds`` times (the cost model's
    set-up and the searches), run by turns so both meet the same load (the suite's other worker runs beside
    this test): the guard set by the first (as if just committed) fails the second, by the code ``--check``
    runs."""
    import tensoropt.planning as planning
    row = next(row for row in search_speed.ROWS if row[0] == "llama3-8b/64 h100")
    captured = search_speed.capture_rows(tmp_path, [row])
    real_search, real_cost = planning.search, planning.ModelCost
    runs: dict[str, list[dict]] = {"as committed": [], "slower": []}
    for _ in range(15):                 # 15 runs each: their medians a few percent apart on a loaded machine
        for kind in runs:
            slow = kind == "slower"
            monkeypatch.setattr(planning, "search", _slower(real_search, 1.4) if slow else real_search)
            monkeypatch.setattr(planning, "ModelCost", _slower(ModelCost, 1.4) if slow else real_cost)
            runs[kind].append(search_speed.time_row(captured, row))
    reference = min(r["reference_s"] for kind in runs.values() for r in kind)
    committed, slower = (search_speed.row_result(captured, row, runs[kind], reference) for kind in runs)
    guards = {committed["label"]: committed["reference_ratio"]}
    assert search_speed.compare([committed], guards, search_speed.SLOWDOWN) == []
    assert search_speed.compare([slower], guards, search_speed.SLOWDOWN) == [row[0]]
