"""``tensoropt.plan``: the one planning entry point behind ``tensoropt frontier`` and ``tensoropt launch``."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import SMALL_GPT

import tensoropt
from tensoropt.cli import cli
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.planning import NoPlanFitsError, folded
from tensoropt.search.engines import unsupported
from tensoropt.space.plan import Plan

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


@pytest.mark.slow
def test_the_frontier_offers_what_launch_runs_at_the_price_launch_gives_it(model, tmp_path):
    """One accounting: ``tensoropt frontier --model M`` (bf16-mixed by default) and ``tensoropt launch`` of a script
    that builds M (benchmarks/preset_train.py, captured by the launcher as every script is) agree: the frontier's
    fastest point within the devices' memory is the plan launch chooses, at the same time and memory, on the same
    engine; and every point of the frontier names an engine that runs it."""
    from workers import ENV, tensoropt_cli
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "preset_train.py"
    env = {k: v for k, v in ENV.items() if k != "TENSOROPT_PRECISION"}        # launch's own default precision
    launched = tensoropt_cli("launch", script, "--device", "cuda", "--gpus", 8, "--dry-run", "--run-dir", tmp_path,
                             "--", "--model", model, "--global-batch", 16, cwd=tmp_path, env=env)
    assert launched.returncode == 0, launched.stderr[-2000:]
    chosen = json.loads((tmp_path / "plan.json").read_text())
    result = CliRunner().invoke(cli, ["frontier", "--model", model, "--gpus", 8, "--global-batch", 16, "--json",
                                      "--mem", "80GiB"])
    assert result.exit_code == 0, result.output
    front = json.loads(result.output)
    best = front["chosen"]
    assert (best["plan"]["summary"], best["engine"]) == (chosen["summary"], chosen["engine"])
    assert best["plan"]["precision"] == chosen["precision"] == "bf16-mixed"
    assert best["iteration_time_s"] == pytest.approx(chosen["predicted"]["iteration_time_s"], rel=1e-9)
    assert best["peak_memory_bytes"] == chosen["predicted"]["peak_memory_bytes"]
    assert all(not unsupported(Plan.from_json(p["plan"]), p["engine"]) for p in front["points"])


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


def test_the_whole_space_prices_each_plan_as_the_engine_that_would_hold_it(model):
    """``engines=None``: the planner's whole space, plans no engine runs included (``engine_of`` ""), each priced in
    the states of the engine that would hold it; never slower than the engines' frontier, of which it holds every
    point it does not beat."""
    graph = tensoropt.capture(model, precision="bf16-mixed").graph
    cluster = [Cluster(8, 4, H100)]
    whole = tensoropt.plan(graph, cluster, global_batch=16, engines=None, fits=False)
    runnable = tensoropt.plan(graph, cluster, global_batch=16, fits=False)
    assert {whole.engine_of(p) for p in whole.points} > {"torch"}
    for point in whole.points:
        engine = whole.engine_of(point)
        assert engine == "" or not unsupported(point.plan, engine)
        assert point.plan.engine in ("torch", "deepspeed") and point.plan.precision == "bf16-mixed"
        assert point.plan.master_weights == (point.plan.engine == "deepspeed")
    assert whole.points[0].iteration_time_s <= runnable.points[0].iteration_time_s
    unrunnable = [p for p in whole.points if not whole.engine_of(p)]
    assert unrunnable and all(p.plan.offload or (p.plan.tp > 1 and p.plan.dp > 1 and p.plan.zero == 0)
                              for p in unrunnable)


def test_the_frontier_command_prices_the_precision_it_is_told(model):
    def points(*precision):
        result = CliRunner().invoke(cli, ["frontier", "--model", model, "--gpus", 8, "--global-batch", 16, "--json",
                                          *precision])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["points"]
    default, fp32 = points(), points("--precision", "32-true")
    assert {p["plan"]["precision"] for p in default} == {"bf16-mixed"} and all(p["engine"] for p in default)
    assert {(p["plan"]["precision"], p["plan"]["dtype"]) for p in fp32} == {("32-true", "float32")}
    assert not any(p["plan"].get("grad_dtype") for p in fp32)
    assert min(p["iteration_time_s"] for p in fp32) > min(p["iteration_time_s"] for p in default)
