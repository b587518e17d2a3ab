"""``tensoropt.plan``: the one planning entry point behind ``tensoropt frontier`` and ``tensoropt launch``."""

import json

import pytest
from click.testing import CliRunner
from conftest import SMALL_GPT

import tensoropt
from tensoropt.cli import cli
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.planning import NoPlanFitsError, folded
from tensoropt.search.engines import unsupported

H100 = load_profile("h100-80gb")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "gpt.json"
    path.write_text(json.dumps(SMALL_GPT | {"hidden_size": 256, "ffn_hidden_size": 1024, "seq_length": 256}))
    return str(path)


def _rows(points) -> list[tuple[str, float, float]]:
    return [(p.plan.summary(), p.iteration_time_s, p.peak_memory_bytes) for p in points]


def test_the_frontier_command_prints_what_plan_returns(model):
    result = CliRunner().invoke(cli, ["frontier", "--model", model, "--gpus", "4,8", "--global-batch", 16, "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)["points"]
    frontier = tensoropt.plan(model, [Cluster(n, n, H100) for n in (4, 8)], global_batch=16)
    assert [(p["plan"]["summary"], p["iteration_time_s"], p["peak_memory_bytes"]) for p in printed] == \
        [(s, t, int(m)) for s, t, m in _rows(frontier.points)]
    assert {p.plan.devices for p in frontier.points} == {4, 8}


def test_every_point_fits_the_budget_unless_asked_otherwise(model):
    graph = tensoropt.capture(model).graph
    everything = tensoropt.plan(graph, Cluster(8, 8, H100), global_batch=16, fits=False)
    budget = sorted(p.peak_memory_bytes for p in everything.points)[len(everything.points) // 2]
    fitting = tensoropt.plan(graph, Cluster(8, 8, H100), global_batch=16, budget=budget)
    assert fitting.points and all(p.peak_memory_bytes <= budget for p in fitting.points)
    assert max(p.peak_memory_bytes for p in everything.points) > budget          # the budget did cut something
    assert _rows(fitting.points) == _rows(p for p in everything.points if p.peak_memory_bytes <= budget)
    assert fitting.points[0] == everything.fastest_within(budget)
    with pytest.raises(NoPlanFitsError, match=r"^no plan fits in 0\.0 GiB per device; the least memory any plan "
                                              r"needs is \d+\.\d\d GiB$"):
        tensoropt.plan(graph, Cluster(8, 8, H100), global_batch=16, budget="1MiB")
    with pytest.raises(TensorOptError, match="give a size with a unit"):
        tensoropt.plan(graph, Cluster(8, 8, H100), global_batch=16, budget="lots")


def test_planned_for_engines_every_point_runs_on_its_engine(model):
    graph = tensoropt.capture(model).graph
    frontier = tensoropt.plan(graph, Cluster(8, 8, H100), global_batch=16, engines=("torch", "deepspeed"),
                              precision="bf16-mixed")
    assert frontier.points and len(frontier.engines) == len(frontier.points)
    for point in frontier.points:
        assert not unsupported(point.plan, frontier.engine_of(point))
        assert point.plan.precision == "bf16-mixed" and point.plan.master_weights == (frontier.engine_of(point) ==
                                                                                     "deepspeed")
    assert folded(graph) is folded(graph)                          # the graph is folded once for every search
    with pytest.raises(TensorOptError, match="^unknown engine 'megatron': use torch or deepspeed$"):
        tensoropt.plan(graph, Cluster(8, 8, H100), global_batch=16, engines=("megatron",))
