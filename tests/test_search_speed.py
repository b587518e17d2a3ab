"""benchmarks/search_speed.py's guard: a search made 1.4x slower fails ``--check``'s comparison (tolerance 1.3x on
the ratio to the machine-speed reference)."""

import sys
import time

import pytest

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
    """The planner as committed and a copy 1.4x slower in everything a row times (``tensoropt.plan``: the searches
    and the cost model they price with), run by turns so both meet the same load (the suite's other worker runs
    beside this test): the guard set by the first (as if just committed) fails the second, by the code ``--check``
    runs."""
    import tensoropt
    row = next(row for row in search_speed.ROWS if row[0] == "llama3-8b/64 h100")
    captured = search_speed.capture_rows(tmp_path, [row])
    real_plan = tensoropt.plan
    runs: dict[str, list[dict]] = {"as committed": [], "slower": []}
    for _ in range(15):                 # 15 runs each: their medians a few percent apart on a loaded machine
        for kind in runs:
            monkeypatch.setattr(tensoropt, "plan", _slower(real_plan, 1.4) if kind == "slower" else real_plan)
            runs[kind].append(search_speed.time_row(captured, row))
    reference = min(r["reference_s"] for kind in runs.values() for r in kind)
    committed, slower = (search_speed.row_result(captured, row, runs[kind], reference) for kind in runs)
    guards = {committed["label"]: committed["reference_ratio"]}
    assert search_speed.compare([committed], guards, search_speed.SLOWDOWN) == []
    assert search_speed.compare([slower], guards, search_speed.SLOWDOWN) == [row[0]]
