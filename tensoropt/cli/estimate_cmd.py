"""``tensoropt estimate``: the what-if of one plan."""

from __future__ import annotations

import dataclasses
import json

import click
from rich.console import Console
from rich.table import Table

from ..cost.model import ModelCost, state_bytes
from ..cost.model import estimate as estimate_plan
from ..errors import TensorOptError
from ..options import check_counts
from ..planning import folded
from ..search.engines import choose_engine, priced_graph, unsupported
from ..search.engines import master_weights as engine_master_weights
from ..search.limits import GRAD_DTYPE_FLAGS
from ..space.context_parallel import graph_refusal
from ..space.experts import with_routing_imbalance
from ..space.plan import PRECISIONS, RECOMPUTE, BlockPlan, LayerStrategy, Plan, compute_dtype
from .common import Loaded, load, model_options
from .format import binary_bytes
from .inspect_cmd import MODEL_HELP

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_PRECISION = "bf16-mixed"          # tensoropt launch's (launcher.launch.default_precision)


def build_plan(model_cost, gpus: int, per_node: int, tp: int, pp: int, virtual: int, zero: int, micro_batch: int,
               global_batch: int, recompute: str, sequence_parallel: bool, dtype: str,
               master_weights: bool = True, precision: str = "", compile: bool = False, offload: bool = False,
               grad_dtype: str = "", cp: int = 1, ep: int = 1) -> Plan:
    """The plan the flags describe, or one line naming every operand that does not fit."""
    problems = []
    if gpus % (cp * tp * pp):
        problems.append(f"--cp {cp} x --tp {tp} x --pp {pp} must divide --gpus {gpus}" if cp > 1 else
                        f"--tp {tp} x --pp {pp} must divide --gpus {gpus}")
    dp = max(1, gpus // (cp * tp * pp))
    problems += _context_parallel_problems(model_cost, cp, tp, pp, compile, offload)
    problems += _expert_parallel_problems(model_cost, ep, dp, pp, cp, compile, offload)
    if tp > per_node or per_node % tp:
        problems.append(f"--tp {tp} must divide --gpus-per-node {per_node} (tensor parallelism stays in a node)")
    elif not model_cost.tp_allowed(tp):
        limits = ", ".join(f"{b.name} {b.max_tp}" for s in model_cost.spaces for b in s.branches) or "no TP branch"
        problems.append(f"--tp {tp} must divide every tensor-parallel branch's heads/features ({limits})")
    if model_cost.max_pp % pp:
        problems.append(f"--pp {pp} must divide the {model_cost.max_pp} repeated layers")
    if global_batch % (dp * micro_batch):
        problems.append(f"--global-batch {global_batch} must be a multiple of dp {dp} x --micro-batch {micro_batch}")
    if offload and zero == 0:
        problems.append("--offload moves ZeRO's optimizer partitions to the host: add --zero 1, 2 or 3")
    copies = model_cost.max_pp // pp if model_cost.max_pp % pp == 0 else 1
    if virtual > 1 and (pp == 1 or copies % virtual or (global_batch // max(1, dp * micro_batch)) % pp):
        problems.append(f"--virtual-stages {virtual} needs --pp > 1, must divide the {copies} layers per stage, "
                        "and the micro-batches must be a multiple of --pp")
    if recompute == "selective" and not any(s.attention_core for s in model_cost.spaces):
        problems.append("--recompute selective needs explicit attention scores to drop; this model keeps none "
                        "(use none or full)")
    if problems:
        raise TensorOptError("; ".join(problems))
    strategy = LayerStrategy(recompute, sequence_parallel and tp > 1)
    blocks = tuple(BlockPlan(b.name, ((strategy, b.repeats // pp),)) for b, _ in model_cost.blocks)
    return Plan(gpus, dp, tp, pp, micro_batch, global_batch, virtual, zero, offload, model_cost.branch_names if tp > 1
                else (), DTYPES[dtype], blocks, master_weights, precision, compile, grad_dtype=grad_dtype, cp=cp, ep=ep)


def _context_parallel_problems(model_cost, cp: int, tp: int, pp: int, compile: bool, offload: bool) -> list[str]:
    """What keeps ``--cp`` from running (``space.context_parallel``; the runtime runs it with pp 1, eager, no
    offload), each naming the flag to change."""
    if cp <= 1:
        return []
    problems = [f"--cp {cp}: {why}" for why in [graph_refusal(model_cost.graph, cp)] if why]
    problems += [f"--cp {cp} runs with {need}: {change}" for need, change, bad in [
        ("pp 1", "give --pp 1 or drop --cp", pp > 1),
        ("eager kernels", "drop --compile or --cp", compile),
        ("no optimizer offload", "drop --offload or --cp", offload)] if bad]
    return problems


def _expert_parallel_problems(model_cost, ep: int, dp: int, pp: int, cp: int, compile: bool, offload: bool
                              ) -> list[str]:
    """What keeps ``--ep`` from running (``space.experts``; the runtime runs it on ranks taken from dp, with pp 1, no
    context parallelism, eager, no offload), each naming the flag to change."""
    if ep <= 1:
        return []
    problems = [f"--ep {ep}: {why}" for why in [model_cost.experts.refusal(ep)] if why]
    problems += [f"--ep {ep} runs with {need}: {change}" for need, change, bad in [
        (f"ranks taken from data parallelism (dp {dp})", "give an --ep dividing dp = gpus / (cp x tp x pp)", dp % ep),
        ("pp 1", "give --pp 1 or drop --ep", pp > 1), ("cp 1", "drop --cp or --ep", cp > 1),
        ("eager kernels", "drop --compile or --ep", compile),
        ("no optimizer offload", "drop --offload or --ep", offload)] if bad]
    return problems


def on_engine(plan: Plan, engine: str) -> Plan:
    """``plan`` as ``engine`` runs it (``launch --engine``): priced with the engine's buffers and, where a precision
    is named, the master copy the engine keeps in it (``search.engines.master_weights``, as the launcher plans);
    one line naming what the engine cannot run."""
    if problems := unsupported(plan, engine):
        raise TensorOptError(f"the {engine} engine does not run {', '.join(problems)}: change those flags or drop "
                             f"--engine {engine}")
    keeps = engine_master_weights(engine, plan.precision) if plan.precision else plan.master_weights
    return dataclasses.replace(plan, engine=engine, master_weights=keeps)


def as_launched(plan: Plan, engine: str | None, grad_flag: str | None) -> Plan:
    """``plan`` as ``tensoropt launch --plan`` would run it: on ``engine``, else the engine launch chooses for it
    (``choose_engine``: torch where it runs it, else DeepSpeed); a plan no engine runs is one line. ``grad_flag``
    ``fp32`` must be what that engine reduces in (DeepSpeed's bf16 mode reduces bf16 gradients)."""
    if engine:
        plan = on_engine(plan, engine)
    else:
        try:
            plan = on_engine(plan, choose_engine(plan))
        except TensorOptError as exc:
            raise TensorOptError(f"{exc}: change those flags, or price the plan outside the engines with --dtype and "
                                 "--master-weights/--no-master-weights") from None
    held = state_bytes(plan.dtype, plan.master_weights, plan.precision, max(plan.zero, 1), plan.grad_dtype)
    if grad_flag == "fp32" and held.reduced_bytes != 4:
        raise TensorOptError(f"the {plan.engine} engine reduces this plan's gradients in bf16 in {plan.precision} "
                             "(DeepSpeed's bf16 mode): drop --grad-dtype fp32, or price another engine or precision")
    return plan


def priced(loaded: Loaded, plan: Plan, gpus: int, per_node: int) -> ModelCost:
    """The cost model of the graph ``plan``'s engine computes with (``search.engines.priced_graph``: in bf16-mixed,
    FSDP2 and DeepSpeed with bf16 weights, DDP and pipeline stages with float32 ones under autocast)."""
    graph = priced_graph(loaded.graph, plan.engine, plan.zero, plan.pp, plan.precision) if plan.precision \
        else loaded.graph
    if graph is loaded.graph:
        return loaded.model_cost(gpus, per_node)
    return ModelCost(graph, folded(graph), loaded.model_cost(gpus, per_node).cluster)


@click.command()
@click.option("--model", required=True, help=MODEL_HELP)
@click.option("--gpus", type=int, required=True)
@model_options
@click.option("--tp", type=click.IntRange(min=1), required=True, help="tensor-parallel degree")
@click.option("--pp", type=click.IntRange(min=1), required=True, help="pipeline stages")
@click.option("--cp", type=click.IntRange(min=1), default=1, show_default=True,
              help="context-parallel degree: each sample's sequence split over cp ranks (with --pp 1, the torch "
                   "engine; 2 cp must divide the sequence length)")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
              help="expert-parallel degree of a Mixture-of-Experts model: its experts sharded over ep of the "
                   "data-parallel ranks, tokens exchanged by all-to-all (with --pp 1, the torch engine; ep must divide "
                   "dp and every layer's experts)")
@click.option("--virtual-stages", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True)
@click.option("--offload", is_flag=True,
              help="ZeRO-Offload: the optimizer's states and step on the host (ZeRO 1-3; of the engines, DeepSpeed "
                   "runs it: add --engine deepspeed to price its buffers)")
@click.option("--micro-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--global-batch", type=click.IntRange(min=1), required=True)
@click.option("--recompute", type=click.Choice(RECOMPUTE), default="none", show_default=True)
@click.option("--sequence-parallel", is_flag=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bf16", show_default=True,
              help="the dtype the weights train in")
@click.option("--master-weights/--no-master-weights", default=True, show_default=True,
              help="16-bit weights with a float32 master copy and float32 AdamW states (mixed precision, 2+2+12 "
                   "bytes per parameter), or everything in --dtype (2+2+4)")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="as `tensoropt launch --precision` (sets --dtype; default bf16-mixed, launch's, unless --dtype or "
                   "--master-weights is given): the model captured in it and priced as its engine holds it: 32-true "
                   "4+4+8 bytes per parameter, bf16-true 2+2+4, bf16-mixed the torch engine's float32 weights (4+4+8, "
                   "bf16 compute) or DeepSpeed's bf16 mode (2+2+12); with --master-weights/--no-master-weights and no "
                   "--engine, bf16-mixed is priced with (DeepSpeed's) or without a master copy, on no engine")
@click.option("--grad-dtype", type=click.Choice(list(GRAD_DTYPE_FLAGS)), default=None,
              help="the dtype gradients are accumulated and reduced in: bf16 under bf16-mixed is the leaner layout "
                   "(FSDP2 ZeRO 1-3 with reduce_dtype=bf16; plan.json \"grad_dtype\"); default the precision's own "
                   "on its engine (float32 in the torch engine's bf16-mixed, bf16 in DeepSpeed's)")
@click.option("--compile/--eager", "compile_", default=False, show_default=True,
              help="price blocks compiled with torch.compile (memory-bound ops fused inside each block copy, as "
                   "`launch --compile` and Megatron-LM's fused kernels run them; the ops outside blocks eager) or "
                   "eager PyTorch, one kernel per op (what the torch engine runs without --compile)")
@click.option("--engine", type=click.Choice(["torch", "deepspeed"]), default=None,
              help="price the plan as this engine of `tensoropt launch --engine` runs it: deepspeed adds its own "
                   "buffers (reduce bucket, ZeRO 3's gathered and prefetched weights), and each engine keeps its own "
                   "master copy (as launch plans it); a plan the engine cannot run is refused (default: the engine "
                   "launch chooses for the plan, torch where it runs it, else DeepSpeed; with --dtype or "
                   "--master-weights/--no-master-weights, no engine, priced as the torch engine runs it)")
@click.option("--json", "as_json", is_flag=True)
def estimate(model, gpus, gpus_per_node, device, seq_len, routing_imbalance, tp, pp, cp, ep, virtual_stages, zero,
             offload, micro_batch, global_batch, recompute, sequence_parallel, dtype, master_weights, precision,
             grad_dtype, compile_, engine, as_json):
    """Estimate one plan's iteration time and peak memory per device (dp = gpus / (cp * tp * pp)), by default as
    `tensoropt launch --plan` would run it: in launch's default precision, on the engine launch chooses."""
    check_counts(devices=gpus, global_batch=global_batch)
    context = click.get_current_context()
    # --dtype or --master-weights describe the states by hand: priced as before precisions were named, on no engine
    # unless one is named; otherwise as launch runs the plan
    by_hand = any(context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
                  for name in ("dtype", "master_weights"))
    if not by_hand:
        precision = precision or DEFAULT_PRECISION
    if grad_dtype == "bf16" and precision != "bf16-mixed":       # before the capture: nothing to price
        raise TensorOptError(f"--grad-dtype bf16 departs from bf16-mixed's float32 gradients only: use --precision "
                             f"bf16-mixed (this plan trains in {precision or 'the --dtype given'})")
    if precision:
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[compute_dtype(precision)]
    # a 16-bit model is captured as it is (bf16); float32 training computes and keeps activations in float32; a named
    # precision is captured as the launcher captures a script in it
    loaded = load(model, device, seq_len, DTYPES[dtype] if dtype == "fp32" and not precision else None,
                  precision if precision else None)
    loaded.graph = with_routing_imbalance(loaded.graph, routing_imbalance)
    cost = loaded.model_cost(gpus, gpus_per_node)
    plan = build_plan(cost, gpus, cost.cluster.devices_per_node, tp, pp, virtual_stages, zero, micro_batch,
                      global_batch, recompute, sequence_parallel, dtype, master_weights, precision or "", compile_,
                      offload, GRAD_DTYPE_FLAGS[grad_dtype] if grad_dtype == "bf16" else "", cp, ep)
    if not by_hand or engine:
        plan = as_launched(plan, engine, grad_dtype)
    cost = priced(loaded, plan, gpus, gpus_per_node)
    result = estimate_plan(cost, plan)
    report = {"iteration_time_s": result.iteration_time_s, "peak_memory_bytes": int(result.peak_memory_bytes),
              "memory_breakdown": {k: int(v) for k, v in result.memory_breakdown.items()},
              "time_breakdown": result.time_breakdown, "plan": plan.to_json(), "model": loaded.graph.name,
              "device_profile": loaded.profile.name,
              "precision": (f"{precision}: " if precision else "") + state_bytes(
                  plan.dtype, plan.master_weights, plan.precision, plan.zero, plan.grad_dtype).precision,
              "fits": result.peak_memory_bytes <= loaded.profile.memory_bytes, "engine": plan.engine or None}
    if as_json:
        click.echo(json.dumps(report))
        return
    title = f"{loaded.graph.name}: {plan.summary()} on {gpus} x {loaded.profile.name}" + \
        (f" ({plan.engine} engine)" if plan.engine else "")
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("iteration time", f"{result.iteration_time_s:.3f} s")
    parts = ("forward_backward_s", "recompute_s", "tensor_parallel_comm_s") + \
        tuple(k for k in ("context_parallel_comm_s", "expert_parallel_comm_s") if k in result.time_breakdown)
    for key, value in result.time_breakdown.items():
        if key in parts:
            continue
        table.add_row(f"  {key.removesuffix('_s').replace('_', ' ')}", f"{value:.3f} s")
        if key == "compute_s":
            for part in parts:
                table.add_row(f"    {part.removesuffix('_s').replace('_', ' ')}",
                              f"{result.time_breakdown[part]:.3f} s")
    table.add_row("peak memory per device", binary_bytes(result.peak_memory_bytes)
                  + ("" if report["fits"] else f"  (> {binary_bytes(loaded.profile.memory_bytes)} on the device)"))
    for key, value in result.memory_breakdown.items():
        table.add_row(f"  {key.removesuffix('_bytes')}", binary_bytes(value))
    table.add_row("model states", report["precision"])
    console = Console(width=120)
    console.print(title)
    console.print(table)
