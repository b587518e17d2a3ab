"""``tensoropt launch``: learn the model from the script, choose a frontier point for the devices
found, write the plan, start the workers through torchrun and exit with their status."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from tensoropt import planning
from tensoropt.cost.model import ModelCost, estimate, state_bytes
from tensoropt.cost.profile import Cluster
from tensoropt.errors import TensorOptError
from tensoropt.frontier import Frontier
from tensoropt.graph.cache import write_json_atomic
from tensoropt.graph.ir import OpGraph
from tensoropt.planning import NoPlanError, NoPlanFitsError, folded
from tensoropt.profiler.store import threads_per_worker
from tensoropt.runtime import PLAN_ENV
from tensoropt.runtime.engines.ds_config import deepspeed_config
from tensoropt.runtime.engines.precision_names import PRECISION_ENV, checked, of_plan
from tensoropt.runtime.engines.precision_names import words as precision_words
from tensoropt.search.engines import (
    COMPILED_PLANS,
    ENGINE_SPACES,
    ENGINES,
    master_weights,
    pipeline_refused,
    priced_graph,
    staged_tp_refused,
)
from tensoropt.search.ft import FrontierPoint
from tensoropt.search.limits import NO_LIMITS, Limits
from tensoropt.space.plan import Plan, compute_dtype
from tensoropt.space.run_plan import Prediction, RunPlan, VocabSplit, tp_layout_from_json
from tensoropt.space.tp_layout import tp_layout
from tensoropt.space.vocab import vocab_layout

from . import workers
from .argv import torchrun_argv
from .capture import capture_script
from .devices import Devices, detect

OBJECTIVES = ("fastest", "min-memory", "balanced")


def choose(points: list[FrontierPoint], memory_bytes: float, objective: str) -> tuple[FrontierPoint, str]:
    fits = [p for p in points if p.peak_memory_bytes <= memory_bytes]
    if not fits:
        least = min(p.peak_memory_bytes for p in points) / 2**30
        raise TensorOptError(f"no plan fits in {memory_bytes / 2**30:.1f} GiB per device; the least memory any "
                             f"plan needs is {least:.2f} GiB (add devices or memory)")
    if objective == "fastest":
        best = min(fits, key=lambda p: p.iteration_time_s)
        why = f"fastest of {len(fits)} frontier points that fit {memory_bytes / 2**30:.1f} GiB"
    elif objective == "min-memory":
        best = min(fits, key=lambda p: p.peak_memory_bytes)
        why = "least memory on the frontier"
    else:
        t0, m0 = min(p.iteration_time_s for p in fits), min(p.peak_memory_bytes for p in fits)
        best = min(fits, key=lambda p: (p.iteration_time_s / t0) * (p.peak_memory_bytes / m0))
        why = "smallest product of time and memory, each relative to its best (the frontier's knee)"
    return best, why


def training_dtype(graph: OpGraph) -> str:
    """The dtype of most of the script's parameters as captured."""
    dtypes = [meta.dtype for _, meta in graph.params]
    return max(set(dtypes), key=dtypes.count) if dtypes else "bfloat16"


def default_precision(graph: OpGraph | None = None) -> str:
    """The precision to plan when none is named: bf16-mixed for a script under its own bf16 autocast, else the
    one the graph was captured in (``capture_script``), else ``TENSOROPT_PRECISION``, else bf16-mixed."""
    if graph is not None and script_autocast(graph) == "bfloat16":
        return "bf16-mixed"
    named = (graph.meta("precision") if graph is not None else None) or os.environ.get(PRECISION_ENV)
    return checked(named, PRECISION_ENV) if named else "bf16-mixed"


def script_autocast(graph: OpGraph) -> str | None:
    """The dtype of the script's own autocast (captured so), None where it has none. A graph captured for
    bf16-mixed has the capture's autocast: the script's, if any, is the same region (``runtime.engines.precision``)."""
    return None if graph.meta("precision") == "bf16-mixed" else graph.meta("autocast")


def check_precision(graph: OpGraph, precision: str, named: bool = True) -> str:
    """The precision to run: ``precision``, except for a script under its own bf16 autocast, which computes in
    bf16 whatever the engine does, so only bf16-mixed says what it runs (``runtime.engines.precision``): a precision
    ``named`` on the command line that contradicts it is a one-line error, a default (``--plan``'s,
    ``TENSOROPT_PRECISION``) gives way to it."""
    if script_autocast(graph) != "bfloat16" or precision == "bf16-mixed":
        return precision
    if named:
        raise TensorOptError(f"the script trains under its own torch.autocast(bfloat16), which --precision "
                             f"{precision} would contradict: use --precision bf16-mixed or remove the autocast")
    return "bf16-mixed"


def planned_precision(plan: Plan, engine: str, precision: str) -> Plan:
    """``plan`` in ``precision`` on ``engine``: its compute dtype, and whether the engine keeps a separate float32
    master copy of bf16 weights (DeepSpeed's bf16 mode; the torch engine's bf16-mixed weights are float32)."""
    return dataclasses.replace(plan, dtype=compute_dtype(precision), precision=precision,
                               master_weights=master_weights(engine, precision), engine=engine)


def cost_model(graph: OpGraph, devices: Devices, per_node: int, plan: Plan | None = None) -> ModelCost:
    """The cost model of this model on these devices; for ``plan`` (its engine, ZeRO stage and precision set, as
    ``planned_precision`` sets them), of the graph its engine runs (``search.engines.priced_graph``)."""
    if plan is not None:
        graph = priced_graph(graph, plan.engine, plan.zero, plan.pp, plan.precision)
    return ModelCost(graph, folded(graph), cluster(devices, per_node))


def cluster(devices: Devices, per_node: int) -> Cluster:
    return Cluster(devices.count, min(per_node, devices.count), devices.profile)


def price(graph: OpGraph, devices: Devices, per_node: int, plan: Plan, engine: str,
          precision: str | None = None) -> FrontierPoint:
    """``plan`` priced for this model on these devices, in ``precision`` (default ``default_precision``) on
    ``engine``."""
    plan = planned_precision(plan, engine, precision or default_precision(graph))
    try:
        result = estimate(cost_model(graph, devices, per_node, plan), plan)
    except (KeyError, ValueError, IndexError) as exc:
        raise TensorOptError(f"plan {plan.summary()} does not fit this model: {exc}") from exc
    return FrontierPoint(plan, result.iteration_time_s, result.peak_memory_bytes)


def runnable_front(graph: OpGraph, devices: Devices, per_node: int, engine: str | None = None,
                   pipeline: bool = True, limits: Limits = NO_LIMITS,
                   precision: str | None = None) -> list[tuple[FrontierPoint, str]]:
    """The frontier of plans an engine can run, whatever their memory: ``tensoropt.plan`` over the engines
    (``engine`` alone if given), fastest first; on a tie the engine listed first in ENGINES wins.
    ``pipeline=False`` leaves pipeline stages out of the space (elastic runs: checkpoints of stages
    are not resharded yet; ``tensoropt.plan`` also leaves them out for a model whose forward returns no loss the
    last stage can compute, ``search.engines.pipeline_refused``). The user's ``limits`` narrow each engine's part
    of the space. Every plan is priced in ``precision`` (default ``default_precision``) as its engine holds it."""
    try:
        front = _plan(graph, devices, per_node, engine, pipeline, limits, precision, fits=False)
    except NoPlanError:
        return []
    return list(zip(front.points, front.engines))


def _engines(engine: str | tuple[str, ...] | None) -> list[str]:
    """The engines whose plans are searched: ``engine`` alone, those of a tuple (``search.engines.CHECKPOINTS``:
    the engines that checkpoint), or all of them."""
    return [engine] if isinstance(engine, str) else list(engine or ENGINES)


def _plan(graph: OpGraph, devices: Devices, per_node: int, engine: str | tuple[str, ...] | None, pipeline: bool,
          limits: Limits, precision: str | None, fits: bool, compile: bool = False) -> Frontier:
    return planning.plan(graph, cluster(devices, per_node), budget=devices.memory_bytes,
                         engines=_engines(engine), limits=limits,
                         precision=precision or default_precision(graph), pipeline=pipeline, fits=fits,
                         compile=compile)


def plan_for(graph: OpGraph, devices: Devices, per_node: int, objective: str,
             engine: str | tuple[str, ...] | None = None, pipeline: bool = True, limits: Limits = NO_LIMITS,
             precision: str | None = None, compile: bool = False) -> tuple[FrontierPoint, str, str, int]:
    """(point, engine, why, frontier size) for the devices found, within the user's ``limits``, in
    ``precision`` (default ``default_precision``): the frontier ``tensoropt.plan`` gives for the devices'
    memory, and the point of it the objective prefers; ``engine``: among that engine's plans (a tuple: those
    engines'), else every engine's; ``compile``: among plans that run compiled blocks."""
    global_batch = int(graph.meta("global_batch") or 0)
    try:
        front = _plan(graph, devices, per_node, engine, pipeline, limits, precision, fits=True, compile=compile)
    except NoPlanError:
        if compile:
            raise TensorOptError(f"no plan that the runtime runs with compiled blocks ({COMPILED_PLANS}) "
                                 f"splits global batch {global_batch} over {devices.count} devices"
                                 + (f" within {limits.flags()}" if limits else "") + ": drop --compile"
                                 + (" or relax the limits" if limits else "")) from None
        if limits:
            engines = f", engine {' or '.join(_engines(engine))}" if engine else ""
            raise TensorOptError(f"no plan the runtime can apply on {devices.count} devices respects {limits.flags()} "
                                 f"(global batch {global_batch}{engines}): "
                                 f"{_pipelines_refused(graph, limits, pipeline) or 'relax the limits'}") from None
        raise TensorOptError(f"no plan the runtime can apply splits global batch {global_batch} over "
                             f"{devices.count} devices: make it a multiple of {devices.count}") from None
    except NoPlanFitsError as exc:
        notes = [f"{exc} (add devices or memory)", f"searched within {limits.flags()}" if limits else "",
                 devices.note or ""]
        raise TensorOptError("; ".join(n for n in notes if n)) from None
    best, why = choose(list(front.points), devices.memory_bytes, objective)
    why += f" (objective {objective}, {len(front.points)} frontier points" + \
        (f"; {limits.describe()})" if limits else ")")
    return best, front.engine_of(best), why, len(front.points)


def _pipelines_refused(graph: OpGraph, limits: Limits, pipeline: bool) -> str | None:
    """Why the plans ``limits`` leave are none: the pipeline stages they ask for (``--pp`` without 1), which this
    model's output does not split into (``search.engines.pipeline_refused``), or with the tensor parallelism they
    ask for (``--tp`` without 1) inside them (``staged_tp_refused``); None for any other reason."""
    stages, degrees = limits.pipeline_stages, limits.tensor_parallel
    if not pipeline or not stages or 1 in stages:
        return None
    if refused := pipeline_refused(graph):
        return f"no pipeline stages: {refused}"
    refused = staged_tp_refused(graph) if degrees and 1 not in degrees else None
    return f"no tensor parallelism inside pipeline stages: {refused}" if refused else None


def run_workers(argv: list[str], env: dict, run_dir: Path) -> None:
    """Run torchrun until its workers finish. Ctrl-C (or SIGTERM) stops the workers and ends the launch as a
    ``KeyboardInterrupt`` (one line, exit status 130); a failure shows the first failing rank's own error and is
    a one-line ``TensorOptError`` (``launcher.workers``), or, when the workers stopped on a checkpoint they could
    not write or load, their own one line (their note in ``run_dir``); torchrun's own output is kept in
    RUN_DIR/torchrun.log."""
    workers.clear_failure_notes(run_dir)
    outcome = workers.run(argv, env, run_dir / "torchrun.log")
    if outcome.interrupted:
        raise KeyboardInterrupt
    if outcome.status:
        if (note := workers.failure_note(run_dir)) and note.get("kind") == "checkpoint":
            raise TensorOptError(note["message"])       # the workers' own line (runtime.run.exit_on_checkpoint_error)
        logs = f"; every rank's output: {run_dir / 'logs'}" if outcome.output.last else ""
        raise TensorOptError(workers.report(outcome) + logs)
    workers.release_held(outcome.output)


def main_env(devices: Devices, plan_path: Path) -> dict:
    env = {**os.environ, PLAN_ENV: str(plan_path)}
    if devices.kind == "cpu":
        env["OMP_NUM_THREADS"] = "1"            # two threads per worker on two cores was 100x slower
        env["CUDA_VISIBLE_DEVICES"] = ""        # CPU workers on a GPU machine: neither torch nor DeepSpeed uses one
        # --compile: inductor compiles a worker's C++ kernels in a pool of as many processes as the host has cores,
        # each importing torch and inductor; with every core already running a worker, each worker compiles in its
        # own process (tests/test_compile.py's launches on 2 cores: 217 s -> 190 s in one pair of suite runs)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    else:   # else torchrun gives each worker one thread, and an offloaded optimizer runs below its profiled rate
        env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(devices.count)))
    return env


def write_plan(run_dir: Path, point: FrontierPoint, engine: str, why: str, argv: list[str],
               graph: OpGraph, device_kind: str) -> Path:
    """Write plan.json (and for DeepSpeed the exact config it trains with) into the run directory;
    the plan names the kind of device its workers train on (``cuda`` or ``cpu``), and a tensor-parallel
    plan carries which linears of each block are column- and row-parallel, and whether (and which modules) the
    vocabulary is split; any plan, whether its loss runs on the runtime's lean cross-entropy (as it was priced)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    plan, config = point.plan, None
    if engine == "deepspeed":
        config_path = run_dir / "deepspeed.json"
        write_json_atomic(config_path, deepspeed_config(plan, graph.num_parameters))
        config = str(config_path.resolve())
    tensor_parallel, vocab = plan.tp > 1, vocab_layout(graph)
    run_plan = RunPlan(
        plan, engine=engine, device=device_kind,
        tp_layout=tp_layout_from_json(tp_layout(graph)) if tensor_parallel else None,
        vocab_parallel=VocabSplit.from_json(vocab.for_tp(plan.tp)) if tensor_parallel else None,
        lean_loss=vocab.fused_loss,
        deepspeed_config=config,
        predicted=Prediction(point.iteration_time_s, int(point.peak_memory_bytes), precision(plan, graph), why),
        command=tuple(argv))
    path = run_dir / "plan.json"
    write_json_atomic(path, run_plan.to_json())
    return path


def precision(plan: Plan, graph: OpGraph | None = None) -> str:
    """The precision the plan runs and was priced in, in words: its name, the model states' bytes, and the
    script's own autocast where it trains under one (captured so, see ``tensoropt.graph.precision``)."""
    held = state_bytes(plan.dtype, plan.master_weights, plan.precision, plan.zero, plan.grad_dtype).precision
    words = f"{plan.precision_name} ({held})" if plan.precision else held
    autocast = script_autocast(graph) if graph is not None else None
    return words + (f"; compute and activations in {autocast} under the script's autocast" if autocast else "")


def describe(run_plan: RunPlan, engine: str) -> str:
    """The configuration the workers will apply, in words (DeepSpeed's is its config file)."""
    plan = run_plan.plan
    full, selective = (sum(n for bp in plan.blocks for s, n in bp.strategies if s.recompute == kind)
                       for kind in ("full", "selective"))
    sequence = sum(n for bp in plan.blocks for s, n in bp.strategies if s.sequence_parallel)
    if engine == "deepspeed":       # selective recomputation is the runtime's own, not in DeepSpeed's config
        written = json.loads(Path(run_plan.deepspeed_config).read_text()) if run_plan.deepspeed_config else \
            deepspeed_config(plan)
        return "deepspeed config: " + json.dumps(written, sort_keys=True) + (
            f"; precision {precision_words(of_plan(plan), engine, plan.zero, plan.grad_dtype)}") + (
            f"; attention core recomputed (selective) in {selective} block copies" if selective else "")
    vocab = run_plan.vocab_parallel
    copies = sum(n for bp in plan.blocks for _, n in bp.strategies)
    parts = [f"torch.compile on {copies} block copies per stage" if plan.compile else "",
             f"tensor parallel {plan.tp} (ColwiseParallel/RowwiseParallel)" if plan.tp > 1 else "",
             ("vocabulary split over tp (embedding, LM head, loss_parallel)" if vocab.enabled else
              f"vocabulary replicated ({vocab.reason})") if plan.tp > 1 and vocab else "",
             f"pipeline {plan.pp} stages ({plan.grad_accumulation} micro-batches)" if plan.pp > 1 else "",
             f"context parallel {plan.cp} (sequence in {2 * plan.cp} chunks, keys and values all-gathered; data "
             f"parallelism over dp x cp = {plan.dp * plan.cp} ranks)" if plan.cp > 1 else "",
             f"expert parallel {plan.ep} (each rank holds 1/{plan.ep} of every layer's experts, tokens dispatched "
             f"and combined by all-to-all; the experts' data parallelism over dp / ep = {plan.dp // plan.ep} ranks)"
             if plan.ep > 1 else "",
             {0: "DDP" if plan.dp * plan.cp > 1 else "",
              1: "FSDP2 fully_shard (reshard_after_forward=False, gradient sync on the last micro-batch only)",
              2: "FSDP2 fully_shard (reshard_after_forward=False)",
              3: "FSDP2 fully_shard (reshard_after_forward=True)"}.get(plan.zero, ""),
             f"sequence parallel in {sequence} block copies per stage" if sequence and plan.tp > 1 else "",
             f"checkpoint_wrapper on {full} block copies per stage" if full else "",
             f"attention core recomputed (selective) in {selective} block copies per stage" if selective else "",
             f"micro-batches per step: {plan.grad_accumulation} of {plan.micro_batch} samples",
             f"precision {precision_words(of_plan(plan), engine, plan.zero, plan.grad_dtype)}"]
    return "torch: " + ", ".join(p for p in parts if p)


__all__ = ["ENGINE_SPACES", "OBJECTIVES", "Devices", "capture_script", "check_precision", "choose", "default_precision",
           "describe", "detect", "folded", "main_env", "master_weights", "plan_for", "planned_precision", "precision",
           "price", "run_workers", "runnable_front", "torchrun_argv", "write_plan"]
