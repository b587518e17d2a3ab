"""``tensoropt inspect``: capture and fold a model, print what the planner will see."""

from __future__ import annotations

import json
import time

import click
from rich.console import Console
from rich.table import Table

from ..graph.fold import fold
from ..search.engines import pipelines_not_offered
from ..space.experts import experts_report
from ..space.tp_layout import not_offered
from .format import binary_bytes, count, si

MODEL_HELP = "preset name (e.g. gpt3-175b), a JSON config (family or Hugging Face), or FILE.py:FUNCTION"


def positive(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise click.BadParameter(f"must be a positive integer, got {value}")
    return value


def inspect_report(model: str, batch_size: int | None, seq_len: int | None, use_cache: bool) -> dict:
    """Capture + fold and the JSON report of ``inspect --json``."""
    from ..api import capture  # torch: imported when a model is captured, not when the CLI starts
    captured = capture(model, batch_size=batch_size, seq_len=seq_len, cache=use_cache)
    graph = captured.graph
    start = time.perf_counter()
    folded = fold(graph)
    fold_seconds = time.perf_counter() - start
    return {
        "model": graph.name,
        "parameters": graph.num_parameters,
        "ops": len(graph.ops),
        "flops_per_iteration": graph.flops_per_iteration,
        "capture_seconds": round(captured.capture_seconds, 4),
        "cached": captured.cached,
        "batch_size": int(graph.meta("batch_size") or 0) or None,
        "seq_len": int(graph.meta("seq_len") or 0) or None,
        "parameter_bytes": graph.parameter_bytes,
        "saved_activation_bytes": graph.saved_activation_bytes,
        "autocast": graph.meta("autocast") or None,       # the dtype of the autocast the forward runs under
        "folding": folded.summary(positions=True) | {"fold_seconds": round(fold_seconds, 4)},
        # layouts left out of every plan, with their reasons
        "not_offered": not_offered(graph, folded) + pipelines_not_offered(graph),
        "experts": experts_report(graph),          # a Mixture-of-Experts model's experts (None: a dense model)
    }


def _print_tables(report: dict) -> None:
    console = Console()
    summary = Table(title=f"{report['model']}", show_header=False, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [
        ("parameters", count(report["parameters"])),
        ("parameter bytes", binary_bytes(report["parameter_bytes"])),
        ("ops", str(report["ops"])),
        ("ops after folding", str(report["folding"]["ops_after_folding"])),
        ("FLOPs per iteration", si(report["flops_per_iteration"], "FLOP")),
        ("saved activations", binary_bytes(report["saved_activation_bytes"])),
        ("autocast", report["autocast"] or "none"),
        ("batch size / seq len", f"{report['batch_size'] or 'n/a'} / {report['seq_len'] or 'n/a'}"),
        ("capture time", f"{report['capture_seconds']:.2f} s" + (" (cached)" if report["cached"] else "")),
        ("fold time", f"{report['folding']['fold_seconds']:.2f} s"),
    ]
    if moe := report.get("experts"):
        rows[1:1] = [("active parameters", count(moe["active_parameters"])),
                     ("experts", f"{moe['layers']} layers x {'/'.join(map(str, moe['experts']))} experts, top-"
                                 f"{'/'.join(map(str, moe['top_k']))} per token"),
                     ("expert parameters", count(moe["expert_parameters"]))]
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
    blocks = Table(title="unique blocks", title_justify="left")
    for col in ("block", "ops", "repeats", "first positions"):
        blocks.add_column(col, justify="left" if col == "block" else "right")
    for b in report["folding"]["unique_blocks"]:
        pos = b["positions"]
        blocks.add_row(b["name"], str(b["ops"]), str(b["repeats"]),
                       ", ".join(map(str, pos[:4])) + (", ..." if len(pos) > 4 else ""))
    if not report["folding"]["unique_blocks"]:
        blocks.add_row("(no repeated substructure)", "", "", "")
    console.print(blocks)
    for line in report["not_offered"]:
        console.print(f"not offered: {line}", markup=False, highlight=False, soft_wrap=True)


@click.command()
@click.option("--model", "model", required=True, help=MODEL_HELP)
@click.option("--batch-size", type=int, default=None, callback=positive, help="micro-batch size (default 1)")
@click.option("--seq-len", type=int, default=None, callback=positive, help="sequence length (default: the model's)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of tables")
@click.option("--no-cache", is_flag=True, help="capture again even if a cached graph exists")
def inspect(model: str, batch_size: int | None, seq_len: int | None, as_json: bool, no_cache: bool) -> None:
    """Capture a model into an operator graph and fold its repeated blocks."""
    report = inspect_report(model, batch_size, seq_len, not no_cache)
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print_tables(report)


__all__ = ["inspect", "inspect_report"]
