"""``tensoropt profile``: measure this machine and write a device profile."""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..cost.profile import DeviceProfile, load_profile
from ..errors import TensorOptError
from ..graph.cache import write_json_atomic
from ..options import MAX_DEVICES_PER_NODE
from ..paths import check_output_dir, check_output_file
from .format import binary_bytes, si


@click.command()
@click.option("--device", "device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--model", default=None, help="also time this model's unique ops forward and backward "
              "(per-op calibration, at batch 1 and the captured shapes)")
@click.option("--nproc", type=click.IntRange(1, MAX_DEVICES_PER_NODE), default=None,
              help="worker processes for the collective benchmarks (default: the GPUs visible; 2 on a CPU); "
                   "with 1, no collective is measured and the links come from --link-profile")
@click.option("--link-profile", default=None,
              help="with one device: the datasheet profile whose links the profile keeps (default: the GPU's "
                   "own datasheet profile, cpu-2core on a CPU)")
@click.option("--quick", is_flag=True, help="fewer sizes (under a minute on a 2-core CPU)")
@click.option("--out", "out_path", default=None,
              help="where to write the profile (default: this machine's profile of the device, "
                   "$TENSOROPT_PROFILE_DIR/DEVICE.json, which `tensoropt launch` then plans with)")
def profile(device: str, model: str | None, nproc: int | None, link_profile: str | None, quick: bool,
            out_path: str | None) -> None:
    """Measure matrix products, memory bandwidth, op overhead, the host link and collectives; write a profile."""
    from ..profiler.ops import calibration_ops
    from ..profiler.run import Settings, calibrate_ops, device_name, run, total_steps
    from ..profiler.store import measured_path

    if out_path:                                   # before measuring: a profile that cannot be written is lost
        check_output_file(out_path, "--out", (".json",))
    nproc = nproc or _visible(device)
    _check_gpus(device, nproc)
    if nproc == 1:
        link_profile = link_profile or _datasheet_of(device)
        load_profile(link_profile)                     # an unknown name is an error before anything runs
    ops = calibration_ops(model) if model is not None else []
    out = Path(out_path) if out_path else measured_path(device_name(device))
    if not out_path:
        check_output_dir(out.parent, "$TENSOROPT_PROFILE_DIR")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = Settings(device, nproc, quick, link_profile if nproc == 1 else None)
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        task = progress.add_task("profiling", total=total_steps(settings) + len(ops))
        advance = _stages(lambda what: progress.update(task, advance=1, description=what), progress.console)
        data = run(out.stem, settings, advance)
        if ops:
            data["op_times"], skipped = calibrate_ops(ops, settings, advance)
            data["metadata"].update(op_times_model=model, op_times_measured=len(data["op_times"]),
                                    op_times_skipped=skipped)
    DeviceProfile.from_json(data)                    # the cost model can read what we write
    write_json_atomic(out, data)                     # all or nothing: an interrupted run writes nothing
    _summary(data, out)


def _stages(update, console):
    """The progress callback; where no terminal shows the bar (a log, a pipe), each kind of step (its first
    word: matmul, all_reduce, ...) is also one line on stderr when it first ends, so a log says how far the run
    got."""
    seen: set[str] = set()

    def advance(what: str) -> None:
        update(what)
        kind = what.split(" ", 1)[0]
        if not console.is_terminal and kind not in seen:
            seen.add(kind)
            click.echo(f"profiling: {what}", err=True)
    return advance


def _visible(device: str) -> int:
    """Worker processes by default: every GPU visible (at least one), 2 on a CPU."""
    if device == "cpu":
        return 2
    import torch
    if not torch.cuda.is_available():
        raise TensorOptError("--device cuda: no CUDA device is visible here; use --device cpu")
    return torch.cuda.device_count()


def _check_gpus(device: str, nproc: int) -> None:
    """One worker per GPU; on a CPU at most one per core (2 on any machine): more would measure contention."""
    if device == "cpu" and nproc > (cores := max(2, os.cpu_count() or 1)):
        raise TensorOptError(f"--nproc {nproc} is more than the {cores} cores here: give --nproc {cores} or fewer")
    if device == "cuda":
        import torch
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if nproc > visible:
            raise TensorOptError(f"--nproc {nproc} needs {nproc} GPUs, {visible} visible")


def _datasheet_of(device: str) -> str:
    if device == "cpu":
        return "cpu-2core"
    import torch

    from ..profiler.store import datasheet_profile
    return datasheet_profile(torch.cuda.get_device_name(0))


def _summary(data: dict, out: Path) -> None:
    table = Table(title=f"{data['name']}: {data['device']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for dtype, rate in sorted(data["peak_flops"].items()):
        table.add_row(f"peak matmul {dtype}", si(rate, "FLOP/s"))
    table.add_row("memory bandwidth", si(data["memory_bandwidth_bytes_per_s"], "B/s"))
    table.add_row("op overhead", f"{data['kernel_overhead_s'] * 1e6:.1f} us")
    link = data["intra_node"]
    table.add_row("links", data["metadata"]["links_from"])
    table.add_row("link bandwidth", si(link["bandwidth_bytes_per_s"], "B/s"))
    table.add_row("link latency", f"{link['latency_s'] * 1e6:.1f} us")
    table.add_row("host link", si(data["host"]["pcie_bandwidth_bytes_per_s"], "B/s"))
    table.add_row("optimizer step", si(data["host"]["cpu_adam_params_per_s"], "params/s"))
    table.add_row("memory", binary_bytes(data["memory_bytes"]))
    if "op_times" in data:
        meta = data["metadata"]
        table.add_row(f"ops of {meta['op_times_model']} timed", f"{meta['op_times_measured']} "
                      f"(+{meta['op_times_skipped']} kept on the roofline)")
    Console().print(table)
    Console().print(f"wrote {out}")
