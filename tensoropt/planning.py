"""``tensoropt.plan``: the one entry point for planning, used by ``tensoropt frontier`` and ``tensoropt launch``.

A model and its devices in, a ``Frontier`` out: the (time, memory per device, devices) Pareto set of plans whose
memory fits the budget (the devices' own memory unless given). By default the space is what the engines run
(``engines=ENGINES``: ``search.engines.ENGINE_SPACES``, ``grad_dtypes`` and ``unsupported``), in the precision
``tensoropt launch`` runs by default (bf16-mixed, or the one the graph was captured in), each point priced as the
engine that runs it holds it and carrying that engine: what ``tensoropt frontier`` shows and ``tensoropt launch``
chooses from. ``engines=None`` searches the planner's whole space, plans no engine runs included (tensor with
data parallelism under ZeRO 0, offload with tensor parallelism or pipelines), each plan still priced as the engine
that would hold it (the torch engine's states without offload, DeepSpeed's with it): what the engines' restrictions
cost (``benchmarks/launch_coverage.py``). The graph is folded once however many device counts and engines are
searched (``folded``), and its cost model on a cluster built once (``model_cost``), so the command line and the
Python API give the same answer from the same work.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .cost.model import GraphFacts, ModelCost
from .cost.profile import Cluster
from .errors import TensorOptError
from .frontier import Frontier
from .graph.bf16_meta import bf16_weights_graph
from .graph.block_names import module_names, picked
from .graph.fold import FoldedGraph, fold
from .graph.ir import OpGraph
from .search.engines import (
    COMPILE_SPACES,
    ENGINE_SPACES,
    ENGINES,
    grad_dtypes,
    master_weights,
    pipeline_refused,
    priced_graph,
    staged_tp_refused,
    tp_in_stages,
    unsupported,
)
from .search.ft import FrontierPoint, SearchSpace, search
from .search.limits import NO_LIMITS, Limits
from .search.pareto import nondominated
from .space.context_parallel import graph_refusal
from .space.experts import Experts
from .space.plan import Plan, acts_per_copy, compute_dtype
from .units import parse_bytes

if TYPE_CHECKING:       # capturing needs torch; planning a graph already captured does not
    from torch import nn

    from .api import Captured

# the graphs analysed last, newest first: each with its folding, its whole-graph facts and its cost models
_FOLDED: list[tuple[OpGraph, FoldedGraph, GraphFacts, dict[tuple[Cluster, bool], ModelCost], frozenset[str]]] = []


class NoPlanError(TensorOptError):
    """No plan of the space searched splits the global batch over the devices (or the limits leave none)."""


class NoPlanFitsError(TensorOptError):
    """Plans exist, but none fits the memory budget; ``least_memory_bytes`` is what the leanest one needs."""

    def __init__(self, budget_bytes: float, least_memory_bytes: float):
        self.budget_bytes, self.least_memory_bytes = budget_bytes, least_memory_bytes
        super().__init__(f"no plan fits in {budget_bytes / 2**30:.1f} GiB per device; the least memory any plan needs "
                         f"is {least_memory_bytes / 2**30:.2f} GiB")


def folded(graph: OpGraph) -> FoldedGraph:
    """``fold(graph)``, computed once for each of the two graphs planned last (a launch prices and searches the
    same graph, and in bf16-mixed the one captured with bf16 weights beside it: ``search.engines.priced_graph``)."""
    return _analysed(graph)[1]


def graph_facts(graph: OpGraph) -> GraphFacts:
    """What the cost model reads of the whole graph (``cost.model.GraphFacts``), kept beside its folding."""
    return _analysed(graph)[2]


def model_cost(graph: OpGraph, cluster: Cluster, compile: bool = False) -> ModelCost:
    """The cost model of ``graph`` on ``cluster`` (for compiled blocks or eager ones), built once and kept beside the
    graph's folding: it memoises every layer, loose-op and context-shape price it computes, so a later plan of the
    same graph on the same devices (another budget, objective or engine; ``estimate`` after ``frontier``) prices from
    them instead of pricing every op again."""
    costs = _analysed(graph)[3]
    if (cluster, compile) not in costs:
        costs[(cluster, compile)] = ModelCost(graph, folded(graph), cluster, compile, graph_facts(graph))
    return costs[(cluster, compile)]


def _analysed(graph: OpGraph) -> tuple[OpGraph, FoldedGraph, GraphFacts, dict[tuple[Cluster, bool], ModelCost],
                                       frozenset[str]]:
    for seen in _FOLDED:
        if seen[0] is graph:
            return seen
    folding = fold(graph)
    _FOLDED[:] = [(graph, folding, GraphFacts.of(graph), {}, _unfound(graph, folding)), *_FOLDED[:1]]
    return _FOLDED[0]


def plan(model: str | nn.Module | Captured | OpGraph, devices: Cluster | Sequence[Cluster], *,
         budget: float | str | None = None, engines: Sequence[str] | None = ENGINES, global_batch: int | None = None,
         example_inputs: tuple | Mapping | None = None, seq_len: int | None = None, limits: Limits = NO_LIMITS,
         precision: str | None = None, pipeline: bool = True, fits: bool = True, fold_blocks: bool = True,
         compile: bool = False) -> Frontier:
    """The frontier of plans for ``model`` on ``devices``, fastest first.

    ``model``: a ``--model`` string (captured in ``precision``, as ``tensoropt frontier`` does), a module with
    ``example_inputs``, or a captured graph. ``devices``: a
    ``Cluster`` (count, per node, profile), or several of one profile to span device counts. ``budget``: memory
    per device (bytes or ``"40GiB"``; default the profile's); with ``fits=False`` plans over it are kept too.
    ``engines`` (default both, ``ENGINES``): only what they run, each point's engine in ``Frontier.engine_of``;
    ``None``: the planner's whole space (module doc), ``engine_of`` "" for the plans no engine runs.
    ``precision`` (``bf16-mixed``...; default the graph's, else ``bf16-mixed`` as ``tensoropt launch``) prices the
    model states as each engine holds them; compute and activations are the graph's as captured (capture in the
    precision, ``tensoropt.capture(..., precision=...)``, to price them as the launcher does).
    ``global_batch`` defaults to the one the graph records (a launch's script). ``pipeline=False`` leaves
    pipeline stages out; ``fold_blocks=False`` searches copy by copy. ``compile``: every plan runs its blocks
    compiled (``torch.compile``) and is priced so; with ``engines``, only what they run compiled
    (``search.engines.COMPILE_SPACES``). One-line ``TensorOptError`` when no plan
    exists (``NoPlanError``) or none fits (``NoPlanFitsError``)."""
    graph, capture_seconds = _graph(model, example_inputs, seq_len, precision)
    clusters = [devices] if isinstance(devices, Cluster) else list(devices)
    if not clusters:
        raise TensorOptError("plan needs at least one Cluster of devices")
    profile = clusters[0].profile
    global_batch = global_batch or int(graph.meta("global_batch") or 0)
    precision = precision or graph.meta("precision") or "bf16-mixed"
    if global_batch < 1:
        raise TensorOptError("give global_batch: the samples per iteration (the graph records none)")
    budget_bytes = _bytes(budget) if budget is not None else profile.memory_bytes
    _check_context_parallel(graph, limits, engines, [c.num_devices for c in clusters], compile)
    _check_expert_parallel(graph, limits, engines, [c.num_devices for c in clusters], compile)
    folding = folded(graph)
    # the graphs that price each part of the space, each folded (and its whole-graph facts read) before the clock
    # starts: that is analysis of the graph, not search
    parts = [(cluster, runs, priced, part)
             for cluster in clusters for space, runs in _spaces(graph, global_batch, engines, precision, pipeline,
                                                                limits, compile)
             for priced, part in by_graph(graph, space.engine, space, cluster.num_devices)]
    for _, _, priced, _ in parts:
        folded(priced)
    start = time.perf_counter()                             # search_seconds: the search alone, as before
    candidates: list[tuple[FrontierPoint, str]] = []        # in ENGINES order: of two equal points the first is kept
    for cluster, runs, priced, part in parts:
        points = search(model_cost(priced, cluster, compile), cluster.num_devices, part, doubling=fold_blocks,
                        runs=lambda p, runs=runs: runs(p) is not None).points
        candidates += [(p, engine) for p in points if (engine := runs(p.plan)) is not None]
    if not candidates:
        raise NoPlanError(f"no plan splits global batch {global_batch} over {[c.num_devices for c in clusters]} "
                          "devices" + (f" within {limits.flags()}" if limits else ""))
    if fits:
        within = [c for c in candidates if c[0].peak_memory_bytes <= budget_bytes]
        if not within:
            raise NoPlanFitsError(budget_bytes, min(p.peak_memory_bytes for p, _ in candidates))
        candidates = within
    values = np.array([[p.iteration_time_s, p.peak_memory_bytes, p.plan.devices] for p, _ in candidates])
    keep = sorted(nondominated(values), key=lambda i: (values[i, 0], values[i, 1]))
    batch = int(graph.meta("batch_size") or 1)
    return Frontier(graph.name, tuple(c.num_devices for c in clusters), clusters[0].devices_per_node, profile.name,
                    global_batch, int(graph.meta("seq_len") or 0) or None,
                    graph_facts(graph).flops_per_iteration / batch,
                    profile.peak("bfloat16"), tuple(candidates[i][0] for i in keep), time.perf_counter() - start,
                    capture_seconds, folding.summary(),
                    engines=tuple(candidates[i][1] for i in keep))


def _graph(model, example_inputs, seq_len, precision: str | None) -> tuple[OpGraph, float]:
    """The graph to plan: as given, or captured; a ``--model`` string in ``precision`` (default bf16-mixed) as the
    launcher captures a script, a module as it computes (under the caller's autocast, if any)."""
    if isinstance(model, OpGraph):
        return model, 0.0
    from .api import Captured, capture
    if isinstance(model, Captured):
        captured = model
    elif isinstance(model, str):
        captured = capture(model, seq_len=seq_len, precision=precision or "bf16-mixed")
    else:
        captured = capture(model, example_inputs, seq_len=seq_len)
    return captured.graph, captured.capture_seconds


def _spaces(graph: OpGraph, global_batch: int, engines: Sequence[str] | None, precision: str, pipeline: bool,
            limits: Limits, compile: bool = False) -> list[tuple[SearchSpace, Callable[[Plan], str | None]]]:
    """(space, runs) pairs to search, each space priced for its ``engine`` in ``precision``; ``runs(plan)`` is the
    engine that runs a plan found there ("" for none), None to drop it. With ``engines``, each engine's part: a
    model whose forward returns no loss the last pipeline stage can compute (a tuple, say:
    ``search.engines.pipeline_refused``) has no pipeline plans, one returning a Hugging Face output with ``.loss``
    none with tensor parallelism inside the stages (``staged_tp_refused``), and with ``compile`` only the engines
    that compile, narrowed to what they run compiled (``COMPILE_SPACES``). Without,
    the whole space (module doc): the torch engine's states for every plan without offload, DeepSpeed's for its own
    part and for the offloading plans no engine runs (none with ``compile``: DeepSpeed runs eager). A part the
    ``limits`` empty is not searched."""
    unfound = unfound_blocks(graph)
    torch_runs = _runs_on("torch", staged=pipeline_refused(graph) is None,
                          staged_tp=staged_tp_refused(graph) is None, unfound=unfound)
    if engines is None:
        whole = {} if pipeline else {"pipeline_stages": (1,)}
        parts = [("torch", whole | {"offload": False}, lambda p: torch_runs(p) or "")]
        parts += [] if compile else [
            ("deepspeed", ENGINE_SPACES["deepspeed"], lambda p: None if unsupported(p, "deepspeed") else "deepspeed"),
            ("deepspeed", whole, lambda p: "" if p.offload and unsupported(p, "deepspeed") else None)]
    else:
        unknown = [e for e in engines if e not in ENGINE_SPACES]
        if unknown:
            raise TensorOptError(f"unknown engine {unknown[0]!r}: use {' or '.join(ENGINES)}")
        split = pipeline and pipeline_refused(graph) is None
        parts = [(e, ENGINE_SPACES[e] | (COMPILE_SPACES[e] if compile else {})
                  | ({} if split else {"pipeline_stages": (1,)}),
                  torch_runs if e == "torch" else _runs_on(e, unfound=unfound))
                 for e in engines if not compile or e in COMPILE_SPACES]
    spaces = []
    for engine, part, runs in parts:
        space = limits.restrict(SearchSpace(global_batch=global_batch, dtype=compute_dtype(precision),
                                            precision=precision, master_weights=master_weights(engine, precision),
                                            engine=engine, grad_dtypes=grad_dtypes(engine, precision), **part))
        if space is not None:
            spaces.append((space, runs))
    return spaces


def _check_context_parallel(graph: OpGraph, limits: Limits, engines: Sequence[str] | None, devices: list[int],
                            compile: bool) -> None:
    """One line naming what to change where ``limits`` name a context-parallel degree nothing here runs: a model
    that refuses it or a sequence 2 cp does not divide (``space.context_parallel.graph_refusal``), or what
    ``_check_degrees`` names. (Without ``--cp`` the search tries only the degrees that run.)"""
    _check_degrees("--cp", "context parallelism", limits.context_parallel, lambda cp: graph_refusal(graph, cp),
                   engines, devices, compile)


def _check_expert_parallel(graph: OpGraph, limits: Limits, engines: Sequence[str] | None, devices: list[int],
                           compile: bool) -> None:
    """One line naming what to change where ``limits`` name an expert-parallel degree nothing here runs: a model
    without experts or whose experts it does not divide (``space.experts``), or what ``_check_degrees`` names.
    (Without ``--ep`` the search tries the degrees that run.)"""
    _check_degrees("--ep", "expert parallelism", limits.expert_parallel, Experts.of(graph).refusal, engines, devices,
                   compile)


def _check_degrees(flag: str, what: str, degrees: tuple[int, ...] | None, refusal: Callable[[int], str],
                   engines: Sequence[str] | None, devices: list[int], compile: bool) -> None:
    """The first degree > 1 of ``degrees`` (a limit given by ``flag``) nothing here runs, in one line: the model's
    ``refusal``, no torch engine among ``engines`` (only it runs ``what``), compiled blocks (it runs eager), a degree
    dividing none of the device counts."""
    for degree in [d for d in degrees or () if d > 1]:
        why = refusal(degree) or None
        if why is None and engines is not None and "torch" not in engines:
            why = f"{what} runs in the torch engine only: drop --engine deepspeed or {flag}"
        if why is None and compile:
            why = f"{what} runs eager kernels only: drop --compile or {flag}"
        if why is None and all(n % degree for n in devices):
            why = f"it divides none of the device counts {devices}: give a {flag} that divides --gpus"
        if why:
            raise TensorOptError(f"{flag} {degree}: {why}")


def _runs_on(engine: str, staged: bool = True, staged_tp: bool = True,
             unfound: frozenset[str] = frozenset()) -> Callable[[Plan], str | None]:
    """``engine`` for the plans it runs, None for the others (its part of the space holds some it does not). Of a
    model whose output the stages cannot split (``staged=False``: ``search.engines.pipeline_refused``) it runs no
    pipeline plan; of one whose stages run without tensor parallelism (``staged_tp=False``: ``staged_tp_refused``)
    none with both; of a block whose name finds no copies (``unfound``: ``unfound_blocks``) none that acts on them
    one by one (``space.plan.acts_per_copy``: the runtime refuses it)."""
    def runs(plan: Plan) -> str | None:
        refused = unsupported(plan, engine) or (plan.pp > 1 and not staged) or (tp_in_stages(plan) and not staged_tp) \
            or any(bp.block in unfound and acts_per_copy(plan, bp, engine) for bp in plan.blocks)
        return None if refused else engine
    return runs


def unfound_blocks(graph: OpGraph) -> frozenset[str]:
    """The names of the graph's blocks that find other modules than their copies among those its ops ran in
    (``graph.block_names.picked``, what the runtime reads off the model): a copy spanning two modules
    (``layers.{0,1}``), copies of no common scope (``block<i>``). Kept beside the graph's folding."""
    return _analysed(graph)[4]


def _unfound(graph: OpGraph, folding: FoldedGraph) -> frozenset[str]:
    modules = module_names(graph.ops)
    return frozenset(b.name for b in folding.blocks if _picked(modules, b.name) != [o.scope for o in b.occurrences])


def _picked(paths: list[str], name: str) -> list[str] | None:
    try:
        return picked(paths, name)
    except ValueError:
        return None


def by_graph(graph: OpGraph, engine: str, space: SearchSpace, devices: int) -> list[tuple[OpGraph, SearchSpace]]:
    """``space`` split by the graph that prices its plans (``search.engines.priced_graph``): in bf16-mixed, the
    plans whose engine computes with bf16 weights (FSDP2's ZeRO 1-3, pipeline stages too, and DeepSpeed) are
    searched on the graph captured so, the others on ``graph``. A graph without that capture prices the whole
    space. (``devices``: the count searched; the graph depends on the ZeRO stage only.)"""
    if bf16_weights_graph(graph) is None:
        return [(graph, space)]
    cells: dict[int, tuple[OpGraph, list[int]]] = {}
    for zero in space.zero_stages:
        priced = priced_graph(graph, engine, zero, 1, space.precision)
        cells.setdefault(id(priced), (priced, []))[1].append(zero)
    if len(cells) < 2:                              # one graph prices them all: one search
        return [(next(iter(cells.values()))[0] if cells else graph, space)]
    return [(priced, dataclasses.replace(space, zero_stages=tuple(zeros))) for priced, zeros in cells.values()]


def _bytes(budget: float | str) -> float:
    if isinstance(budget, str):
        return parse_bytes(budget, "budget")
    if budget <= 0:
        raise TensorOptError(f"budget {budget}: give a positive memory per device, e.g. 40 * 2**30 or '40GiB'")
    return float(budget)


__all__ = ["NoPlanError", "NoPlanFitsError", "by_graph", "folded", "plan"]
