"""A check the planner's tests share: frontier tracking against brute force on a space small enough to enumerate."""

import numpy as np
import pytest

from tensoropt.cost.model import estimate
from tensoropt.search.exhaustive import exhaustive_search
from tensoropt.search.ft import SearchResult, search


def ft_equals_exhaustive(model, devices: int, space) -> SearchResult:
    """FT's result on ``devices`` after checking that its frontier is brute force's (rtol 1e-12: the same floats but
    for summation order) and that each of its points is priced as ``estimate`` prices its plan."""
    ft, brute = search(model, devices, space), exhaustive_search(model, devices, space)
    front = np.array([[p.iteration_time_s, p.peak_memory_bytes] for p in ft.points])
    np.testing.assert_allclose(front, [[p.iteration_time_s, p.peak_memory_bytes] for p in brute.points], rtol=1e-12)
    for point in ft.points:
        e = estimate(model, point.plan)
        assert e.iteration_time_s == pytest.approx(point.iteration_time_s, rel=1e-12)
        assert e.peak_memory_bytes == pytest.approx(point.peak_memory_bytes, rel=1e-12)
    return ft
