"""The ``tensoropt launch`` command (registered into the ``tensoropt`` CLI)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from tensoropt.errors import TensorOptError
from tensoropt.options import limit_options
from tensoropt.runtime import RUN_DIR_ENV
from tensoropt.runtime.checkpoint.files import KEEP
from tensoropt.search.engines import (
    CHECKPOINTS,
    COMPILE_SPACES,
    choose_engine,
    pipeline_refused,
    pipelines_not_offered,
    staged_tp_refused,
    tp_in_stages,
)
from tensoropt.search.ft import FrontierPoint
from tensoropt.space.context_parallel import graph_refusal
from tensoropt.space.experts import Experts
from tensoropt.space.plan import PRECISIONS
from tensoropt.space.run_plan import RunPlan
from tensoropt.space.tp_layout import not_offered

from . import launch as L
from .checkpoints import check_room, checkpoint_env
from .inputs import check_counts, check_mem_per_gpu, check_paths, read_plan
from .memory import simulate_and_compare
from .nodes import DEFAULT_RENDEZVOUS_TIMEOUT_S, check_nodes, fetch, plan_port, publish


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("script")
@click.option("--gpus", type=click.IntRange(min=1), default=None, help="devices to use (default: all found)")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="cuda (default where GPUs are visible; with --dry-run also where none are) or cpu: --gpus CPU "
                   "workers over gloo")
@click.option("--profile", default=None,
              help="device profile to plan with: a name in profiles/ or a path (default: this machine's measured "
                   "profile of the device if `tensoropt profile` wrote one, else its datasheet profile, cpu-2core for "
                   "--device cpu)")
@click.option("--mem-per-gpu", default=None, help="memory per device to plan for (default: what is free)")
@click.option("--objective", type=click.Choice(L.OBJECTIVES), default="fastest", show_default=True)
@click.option("--plan", "plan_path", default=None, help="run this plan (a previous launch's plan.json)")
@click.option("--engine", type=click.Choice(["deepspeed", "torch"]), default=None,
              help="run with this engine (default: the plan decides: torch where it can, else DeepSpeed)")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="bf16-mixed (float32 weights and AdamW states, bf16 compute), bf16-true (all bf16) or 32-true (all "
                   "float32), as PyTorch Lightning names them (default: --plan's, else $TENSOROPT_PRECISION, else "
                   "bf16-mixed)")
@click.option("--compile", "compile_", is_flag=True,
              help="run every copy of the model's repeated blocks (each transformer layer) under torch.compile, as "
                   "torchtitan does, and plan with compiled kernels' prices (plan.json \"compile\": true); torch "
                   "engine: DDP or FSDP2 ZeRO 3, no or full recomputation, no tensor parallelism or pipeline")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--master-addr", default=None)
@click.option("--master-port", type=click.IntRange(1, 65535), default=None)
@click.option("--rendezvous-timeout", "rendezvous_timeout_s", type=click.IntRange(min=1),
              default=DEFAULT_RENDEZVOUS_TIMEOUT_S, show_default=True,
              help="seconds a node's torchrun waits for the other nodes before it stops (--nnodes > 1)")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None, help="for planning (default: --gpus)")
@click.option("--dry-run", is_flag=True, help="print the chosen plan and configuration, start nothing")
@click.option("--check-memory", is_flag=True,
              help="with --dry-run: simulate rank 0's step of the plan on fake tensors, print its peak memory by "
                   "category beside the prediction")
@click.option("--run-dir", default="tensoropt-run", show_default=True, help="where plan.json is written")
@click.option("--no-cache", is_flag=True, help="capture the script's model again even if its sources are unchanged")
@click.option("--elastic", is_flag=True, help="re-plan and resume when workers fail, memory runs out or devices change")
@click.option("--checkpoint-dir", default=None, help="checkpoint here and resume from the latest one found")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=10, show_default=True, help="steps")
@click.option("--keep-checkpoints", "keep", type=click.IntRange(min=1), default=None,
              help=f"with --checkpoint-dir: keep the newest N checkpoints, the fallback when the newest is damaged "
                   f"(default {KEEP}; older ones are removed once a newer one is whole)")
@click.option("--min-gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="elastic: give up when fewer devices remain")
@click.option("--resources", "resources_file", default=None,
              help='elastic: JSON file {"gpus": N} with the devices available now (watched while the job runs)')
@limit_options
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(script, gpus, device, profile, mem_per_gpu, objective, plan_path, engine, precision, compile_, nnodes,
           node_rank, master_addr, master_port, rendezvous_timeout_s, gpus_per_node, dry_run, check_memory, run_dir,
           no_cache, elastic, checkpoint_dir, checkpoint_every, keep, min_gpus, resources_file, script_args, limits):
    """Choose a frontier point for the devices found and run SCRIPT on it (SCRIPT_ARGS after --)."""
    if not Path(script).is_file():
        raise TensorOptError(f"{script}: no such script")
    if plan_path and limits:
        raise TensorOptError(f"--plan runs the plan given; {limits.flags()} limit the search for one: drop one or "
                             "the other")
    if check_memory and not dry_run:
        raise TensorOptError("--check-memory simulates the plan instead of running it: add --dry-run")
    if elastic:
        _check_elastic(checkpoint_dir, plan_path, engine, nnodes, compile_)
    _check_checkpoints(checkpoint_dir, engine, keep)
    keep = keep or KEEP
    if compile_ and engine and engine not in COMPILE_SPACES:
        raise TensorOptError(f"--compile compiles the torch engine's blocks; the {engine} engine runs eager PyTorch: "
                             f"drop --compile or --engine {engine}")
    check_nodes(nnodes, node_rank, master_addr, dry_run)
    check_counts(device, gpus, nnodes, master_port, min_gpus, elastic)
    memory = check_mem_per_gpu(device, gpus, mem_per_gpu)
    check_paths(run_dir, checkpoint_dir, resources_file, elastic, min_gpus)
    given = read_plan(plan_path) if plan_path else None
    devices = L.detect(device, gpus, memory, profile, dry_run)
    named = precision is not None
    if not named:
        precision = (given and given.get("precision")) or L.default_precision()
    graph = L.capture_script(script, list(script_args), use_cache=not no_cache, precision=precision)
    precision = L.check_precision(graph, precision, named)
    if elastic and not dry_run:
        from .elastic import ElasticOptions, run_elastic
        options = ElasticOptions(Path(checkpoint_dir), checkpoint_every, min_gpus,
                                 Path(resources_file) if resources_file else None, objective, limits,
                                 max_gpus=gpus, keep=keep)
        run_elastic(script, list(script_args), graph, devices, options, Path(run_dir), click.echo)
        return
    world = devices.count * nnodes
    devices = dataclasses.replace(devices, count=world)
    per_node = gpus_per_node or devices.count // nnodes
    shared = nnodes > 1 and not dry_run          # one plan for every node: node 0's, or the --plan all are given
    if plan_path or (shared and node_rank > 0):
        if plan_path:
            data, source = given, plan_path
            why = f"given with --plan {plan_path}, priced for this model on these devices"
        else:
            data, source = fetch(master_addr, master_port, node_rank), "node 0's plan"
            why = f"node 0's plan, shared at {master_addr}:{plan_port(master_port)}, priced for this model here"
            shared_plan = RunPlan.from_json(data, source)
            engine = shared_plan.engine or engine                       # node 0 chose it
            if (shared_plan.plan.precision or precision) != precision:  # and its precision: every node runs one
                if named:
                    raise TensorOptError(f"node 0 runs --precision {shared_plan.plan.precision}, this node was "
                                         f"given {precision}: give every node the same --precision")
                precision = shared_plan.plan.precision
                graph = L.capture_script(script, list(script_args), use_cache=not no_cache, precision=precision)
        point, engine = _load_plan(data, source, graph, devices, per_node, engine, precision, compile_)
        if point.peak_memory_bytes > devices.memory_bytes:
            raise TensorOptError(f"{source} needs {point.peak_memory_bytes / 2**30:.2f} GiB per device, the devices "
                                 f"have {devices.memory_bytes / 2**30:.2f} GiB" +
                                 (f"; {devices.note}" if devices.note else ""))
    else:       # a launch that checkpoints chooses among the plans of the engines that checkpoint (as elastic.py)
        asked = engine
        point, engine, why, _ = L.plan_for(graph, devices, per_node, objective,
                                           (engine or tuple(CHECKPOINTS)) if checkpoint_dir else engine,
                                           pipeline=not elastic, limits=limits, precision=precision, compile=compile_)
        if checkpoint_dir and not asked:
            why += f"; among the plans of the engines that checkpoint ({', '.join(CHECKPOINTS)}): --checkpoint-dir"
    if checkpoint_dir and engine not in CHECKPOINTS:      # a plan given (--plan, node 0's) for another engine
        raise TensorOptError(f"--checkpoint-dir: the plan runs on the {engine} engine, which does not checkpoint "
                             f"(checkpoints are written with {', '.join(CHECKPOINTS.values())}): add --engine "
                             f"{next(iter(CHECKPOINTS))}")
    room = check_room(Path(checkpoint_dir), point.plan, graph, keep, checkpoint_every) if checkpoint_dir else ""
    argv = L.torchrun_argv(script, list(script_args), world // nnodes, nnodes, node_rank, master_addr, master_port,
                           log_dir=str(Path(run_dir).resolve() / "logs"), rendezvous_timeout_s=rendezvous_timeout_s)
    plan_file = L.write_plan(Path(run_dir), point, engine, why, argv, graph, devices.kind)
    click.echo(f"devices: {world} x {devices.kind} ({devices.memory_bytes / 2**30:.1f} GiB each), profile "
               f"{devices.profile_name}" + (f"; {devices.note}" if devices.note else ""))
    for line in not_offered(graph, L.folded(graph)) + pipelines_not_offered(graph):
        click.echo(f"not offered: {line}")
    click.echo(f"chosen: {point.plan.summary()} (engine {engine})")
    click.echo(f"predicted: {point.iteration_time_s:.4f} s/iteration, {point.peak_memory_bytes / 2**30:.2f} GiB "
               f"per device; {why}")
    click.echo(f"model states: {L.precision(point.plan, graph)}")
    if room:
        click.echo(room)
    click.echo(L.describe(RunPlan.read(plan_file), engine))
    click.echo(f"plan: {plan_file}")
    click.echo("command: " + " ".join(argv))
    if check_memory:
        simulate_and_compare(script, list(script_args), plan_file, engine,
                             L.cost_model(graph, devices, per_node, point.plan), point, devices, click.echo)
    if dry_run:
        return
    store = publish(master_addr, master_port, json.loads(plan_file.read_text())) if shared and node_rank == 0 else None
    env = L.main_env(devices, plan_file.resolve()) | {RUN_DIR_ENV: str(Path(run_dir).resolve())}
    if checkpoint_dir:
        env |= checkpoint_env(Path(checkpoint_dir), checkpoint_every, keep)
    try:
        L.run_workers(argv, env, Path(run_dir))
    finally:
        del store                               # node 0 serves its plan until its workers are done


def _check_elastic(checkpoint_dir, plan_path, engine, nnodes, compile_) -> None:
    problems = [problem for problem, bad in (
        ("--elastic needs --checkpoint-dir DIR (where it resumes from)", not checkpoint_dir),
        ("--elastic chooses its plans itself: drop --plan", plan_path),
        ("--elastic runs the torch engine (torch.distributed.checkpoint reshards): drop --engine deepspeed",
         engine == "deepspeed"),
        ("--elastic runs on one node for now: drop --nnodes", nnodes > 1),
        ("--elastic runs eager blocks (its restarts are not tested compiled): drop --compile", compile_)) if bad]
    if problems:
        raise TensorOptError("; ".join(problems))


def _check_checkpoints(checkpoint_dir, engine, keep) -> None:
    if keep is not None and not checkpoint_dir:
        raise TensorOptError("--keep-checkpoints keeps the checkpoints of --checkpoint-dir: add --checkpoint-dir DIR "
                             "or drop --keep-checkpoints")
    if checkpoint_dir and engine and engine not in CHECKPOINTS:
        raise TensorOptError(f"--checkpoint-dir: the {engine} engine does not checkpoint (checkpoints are written "
                             f"with {', '.join(CHECKPOINTS.values())}): drop --engine {engine}, and the launcher "
                             f"chooses among the {', '.join(CHECKPOINTS)} engine's plans")


def _load_plan(data: dict, source: str, graph, devices: L.Devices, per_node: int,
               engine: str | None, precision: str, compile_: bool = False) -> tuple[FrontierPoint, str]:
    """The plan in ``data`` (from ``source``: a file, or node 0) for this script's model on these devices,
    priced again here: a plan's own figures were computed for whatever model and devices it was made for.
    ``compile_`` (``--compile``) compiles its blocks whatever its ``compile`` says."""
    written = RunPlan.from_json(data, source)          # a bad field: one line naming it
    plan = dataclasses.replace(written.plan, compile=True) if compile_ else written.plan
    blocks = {b.name: b.repeats for b in L.folded(graph).blocks}
    planned = {b.block: b.copies * plan.pp for b in plan.blocks}
    if planned != blocks:
        raise TensorOptError(f"{source} is not a plan for this model: its blocks' copies x pp {plan.pp} are "
                             f"{planned}, this script's model repeats {blocks}")
    if plan.devices != devices.count:
        raise TensorOptError(f"{source} is a plan for {plan.devices} devices, this launch has {devices.count}")
    if plan.pp > 1 and (refused := pipeline_refused(graph)):
        raise TensorOptError(f"{source} has {plan.pp} pipeline stages, which this model does not run in: {refused}")
    if tp_in_stages(plan) and (refused := staged_tp_refused(graph)):
        raise TensorOptError(f"{source} runs tp {plan.tp} inside {plan.pp} pipeline stages: {refused}")
    for refused in (graph_refusal(graph, plan.cp), Experts.of(graph).refusal(plan.ep)):
        if refused:             # before any worker starts: the runtime would refuse it in every rank
            raise TensorOptError(f"{source}: {refused}")
    try:
        engine = choose_engine(L.planned_precision(plan, "torch", precision), engine or written.engine or None)
    except TensorOptError as exc:
        raise TensorOptError(f"{source}: {exc}") from exc
    return L.price(graph, devices, per_node, plan, engine, precision), engine
