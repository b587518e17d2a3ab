"""``tensoropt frontier``: the Pareto frontier of plans, and queries on it."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..cost.profile import Cluster, load_profile
from ..errors import TensorOptError
from ..frontier import Frontier, load_frontier, plot_frontier
from ..graph.cache import write_json_atomic
from ..options import check_counts, limit_options
from ..paths import PLOT_SUFFIXES, check_output_file
from ..planning import NoPlanError, NoPlanFitsError, plan
from ..search.limits import NO_LIMITS, Limits
from ..space.experts import with_routing_imbalance
from ..space.plan import PRECISIONS
from ..units import parse_bytes
from .common import model_options, parse_gpus
from .format import binary_bytes
from .inspect_cmd import MODEL_HELP

DEFAULT_GLOBAL_BATCH = 512
DEFAULT_PRECISION = "bf16-mixed"      # tensoropt launch's default (launcher.launch.default_precision)


def run_search(model: str, gpus: list[int], per_node: int, device: str, global_batch: int, seq_len: int | None,
               no_fold: bool, limits: Limits = NO_LIMITS, compile: bool = False,
               precision: str = DEFAULT_PRECISION, routing_imbalance: float = 1.0) -> Frontier:
    """``tensoropt.plan`` for the command's flags: what ``tensoropt launch`` runs, each engine's part of the space in
    ``precision`` (the model captured in it, as the launcher captures a script), each plan priced as the engine that
    runs it holds it; only plans that fit the profile's memory (a plan the devices cannot hold is not a plan), each
    failure one line; ``compile``: among the plans that run compiled blocks (``search.engines.COMPILE_SPACES``),
    priced so."""
    profile = load_profile(device)
    from ..api import capture  # torch: imported when a model is captured, not when the CLI starts
    captured = capture(model, seq_len=seq_len, precision=precision)
    captured = dataclasses.replace(captured, graph=with_routing_imbalance(captured.graph, routing_imbalance))
    # the graph lives as long as this command: keep the collector from walking its ~10^5 objects during the
    # search (a full collection there cost gpt3-175b's search ~70 ms, a third of it)
    gc.freeze()
    clusters = [Cluster(n, min(per_node, n), profile) for n in gpus]
    try:
        return plan(captured, clusters, global_batch=global_batch, limits=limits, fold_blocks=not no_fold,
                    compile=compile, precision=precision)
    except NoPlanError:
        if limits:
            raise TensorOptError(f"no plan for {model} on {gpus} devices respects {limits.flags()} with "
                                 f"--global-batch {global_batch}: relax the limits") from None
        raise TensorOptError(f"no plan runs {model} on {gpus} devices with --global-batch {global_batch}: "
                             "make the global batch a multiple of the data-parallel degrees you allow") from None
    except NoPlanFitsError as exc:
        raise TensorOptError(f"no plan for {model} on {gpus} x {profile.name} fits the device's "
                             f"{binary_bytes(exc.budget_bytes)}; the least memory any plan needs is "
                             f"{binary_bytes(exc.least_memory_bytes)}" + (f" within {limits.flags()}" if limits else "")
                             + " (add devices or pick a larger device profile)") from None


def _check_load(ctx: click.Context, limits: Limits) -> None:
    """``--load`` answers from the saved frontier: options that would describe another search contradict it."""
    names = ("model", "gpus", "gpus_per_node", "device", "seq_len", "global_batch", "no_fold", "compile_", "precision")
    given = [f"--{name.rstrip('_').replace('_', '-')}" for name in names
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE]
    given += [limits.flags()] if limits else []
    if given:
        raise TensorOptError(f"--load answers from the saved frontier, searched for its own model and devices; "
                             f"{', '.join(given)} describe another search: drop them, or drop --load to search")


def print_frontier(frontier: Frontier, chosen, limit: int = 40) -> None:
    precisions = {p.plan.precision for p in frontier.points if p.plan.precision}
    table = Table(title=f"{frontier.model}: {len(frontier.points)} frontier points on {frontier.device_profile} "
                        f"(global batch {frontier.global_batch}" + "".join(f", {name}" for name in sorted(precisions))
                        + "), fastest first", title_justify="left")
    for col in ("", "time/iter", "memory/device", "tokens/s", "MFU", "devices", "engine", "plan"):
        table.add_column(col, justify="left" if col in ("plan", "", "engine") else "right")
    shown = list(frontier.points)
    if len(shown) > limit:
        step = len(shown) / limit
        shown = sorted({shown[int(i * step)] for i in range(limit)} | {shown[-1]} | ({chosen} if chosen else set()),
                       key=lambda p: p.iteration_time_s)
    for p in shown:
        tokens = frontier.tokens_per_s(p)
        table.add_row("*" if p is chosen else "", f"{p.iteration_time_s:.3f} s", binary_bytes(p.peak_memory_bytes),
                      f"{tokens:,.0f}" if tokens else "-", f"{frontier.mfu(p):.1%}", str(p.plan.devices),
                      frontier.engine_of(p) or "-", p.plan.summary())
    console = Console(width=160)
    console.print(table)
    if len(frontier.points) > len(shown):
        console.print(f"({len(frontier.points) - len(shown)} more points in between; --json or --out lists all)")


@click.command()
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--gpus", default=None, help="device count, list (64,128,256) or range (64-1024)")
@model_options
@click.option("--global-batch", type=int, default=DEFAULT_GLOBAL_BATCH, show_default=True, help="samples per iteration")
@click.option("--mem", default=None, help="memory per device, e.g. 40GiB: print the fastest plan that fits")
@click.option("--no-fold", is_flag=True, help="search copy by copy instead of composing folded blocks")
@click.option("--compile", "compile_", is_flag=True,
              help="price every plan with its blocks compiled by torch.compile (fused memory-bound ops), as "
                   "`tensoropt launch --compile` runs them")
@click.option("--precision", type=click.Choice(PRECISIONS), default=DEFAULT_PRECISION, show_default=True,
              help="the training precision, as `tensoropt launch --precision` names it: the model is captured in it "
                   "and each plan priced as the engine that runs it holds it")
@click.option("--plot", "plot_path", default=None, help="write a frontier plot (PNG)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--out", "out_path", default=None, help="save the frontier (JSON) for later queries")
@click.option("--load", "load_path", default=None, help="answer from a saved frontier instead of searching")
@limit_options
def frontier(model, gpus, gpus_per_node, device, seq_len, routing_imbalance, global_batch, mem, no_fold, compile_,
             precision, plot_path, as_json, out_path, load_path, limits):
    """Search the Pareto frontier of plans (iteration time vs peak memory per device) that `tensoropt launch` runs."""
    limit = parse_bytes(mem) if mem is not None else None
    for path, flag, suffixes in ((out_path, "--out", ()), (plot_path, "--plot", PLOT_SUFFIXES)):
        if path:                                    # before the search: a result that cannot be written is lost
            check_output_file(path, flag, suffixes)
    if load_path:
        _check_load(click.get_current_context(), limits)
        result = load_frontier(load_path)
    else:
        if not model or not gpus:
            raise TensorOptError("give --model and --gpus, or --load FILE.json")
        counts = parse_gpus(gpus)
        check_counts(global_batch=global_batch, gpus_per_node=gpus_per_node, devices=counts[-1])
        result = run_search(model, counts, gpus_per_node, device, global_batch, seq_len, no_fold, limits, compile_,
                            precision, routing_imbalance)
    chosen = result.fastest_within(limit) if limit is not None else None
    if out_path:
        write_json_atomic(Path(out_path), result.to_json(chosen))
    if plot_path:
        plot_frontier(result, plot_path, chosen)
    if as_json:
        click.echo(json.dumps(result.to_json(chosen)))
    else:
        print_frontier(result, chosen)
        if chosen is not None:
            click.echo(f"fastest plan within {binary_bytes(limit)}: {chosen.plan.summary()} "
                       f"({chosen.iteration_time_s:.3f} s/iteration, {binary_bytes(chosen.peak_memory_bytes)})")
    if limit is not None and chosen is None:
        raise TensorOptError(f"no plan fits in {binary_bytes(limit)} per device; the least memory any plan needs "
                             f"is {binary_bytes(result.least_memory_bytes)}")

