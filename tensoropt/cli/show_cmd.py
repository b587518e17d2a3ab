"""``tensoropt show``: render a saved frontier or plan."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import TensorOptError
from ..frontier import load_frontier, plot_frontier
from ..paths import PLOT_SUFFIXES, check_output_file
from ..space.plan import Plan
from .frontier_cmd import print_frontier


@click.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", default=None, help="also write the frontier plot (PNG)")
def show(path: str, plot_path: str | None) -> None:
    """Render a saved frontier (from `frontier --out`) or plan JSON."""
    if plot_path:
        check_output_file(plot_path, "--plot", PLOT_SUFFIXES)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TensorOptError(f"{path}: not a readable JSON file ({exc})") from exc
    if isinstance(data, dict) and data.get("kind") == "tensoropt.frontier":
        frontier = load_frontier(path)
        chosen_json = data.get("chosen")
        chosen = None
        if chosen_json:
            chosen = next((p for p in frontier.points if p.plan.to_json() == chosen_json["plan"]), None)
        print_frontier(frontier, chosen)
        if plot_path:
            plot_frontier(frontier, plot_path, chosen)
        return
    if plot_path:
        raise TensorOptError(f"--plot draws a frontier; {path} is not one (a frontier file comes from "
                             "`tensoropt frontier --out`)")
    try:
        plan = Plan.from_json(data.get("plan", data) if isinstance(data, dict) else data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TensorOptError(f"{path}: neither a frontier nor a valid plan file ({exc})") from exc
    click.echo(plan.summary())
    click.echo(f"precision: {plan.precision_name}" + ("" if plan.precision else " (as dtype and master_weights say)"))
    click.echo(json.dumps(plan.to_json(), indent=1))
