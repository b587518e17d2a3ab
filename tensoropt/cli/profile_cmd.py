"""``tensoropt profile``: measure this machine and write a device profile."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..cost.profile import DeviceProfile
from ..errors import TensorOptError
from ..graph.cache import write_json_atomic
from .format import binary_bytes, si


@click.command()
@click.option("--device", "device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--model", default=None, help="also time this model's unique ops forward and backward "
              "(per-op calibration, at batch 1 and the captured shapes)")
@click.option("--nproc", type=click.IntRange(min=2), default=2, show_default=True,
              help="worker processes for the collective benchmarks")
@click.option("--quick", is_flag=True, help="fewer sizes (under a minute on a 2-core CPU)")
@click.option("--out", "out_path", required=True, help="where to write the profile, e.g. profiles/NAME.json")
def profile(device: str, model: str | None, nproc: int, quick: bool, out_path: str) -> None:
    """Measure matrix products, memory bandwidth, op overhead and collectives; write a profile."""
    from ..profiler.ops import calibration_ops
    from ..profiler.run import Settings, calibrate_ops, run, total_steps

    ops = calibration_ops(model) if model is not None else []
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise TensorOptError("--device cuda: no CUDA device is visible here; use --device cpu")
        if torch.cuda.device_count() < nproc:
            raise TensorOptError(f"--nproc {nproc} needs {nproc} GPUs, {torch.cuda.device_count()} visible")
    out = Path(out_path)
    if not out.parent.is_dir():
        raise TensorOptError(f"--out {out}: the folder {out.parent} does not exist")
    settings = Settings(device, nproc, quick)
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        task = progress.add_task("profiling", total=total_steps(settings) + len(ops))
        advance = lambda what: progress.update(task, advance=1, description=what)   # noqa: E731
        data = run(out.stem, settings, advance)
        if ops:
            data["op_times"], skipped = calibrate_ops(ops, settings, advance)
            data["metadata"].update(op_times_model=model, op_times_measured=len(data["op_times"]),
                                    op_times_skipped=skipped)
    DeviceProfile.from_json(data)                    # the cost model can read what we write
    write_json_atomic(out, data)                     # all or nothing: an interrupted run writes nothing
    _summary(data, out)


def _summary(data: dict, out: Path) -> None:
    table = Table(title=f"{data['name']}: {data['device']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for dtype, rate in sorted(data["peak_flops"].items()):
        table.add_row(f"peak matmul {dtype}", si(rate, "FLOP/s"))
    table.add_row("memory bandwidth", si(data["memory_bandwidth_bytes_per_s"], "B/s"))
    table.add_row("op overhead", f"{data['kernel_overhead_s'] * 1e6:.1f} us")
    link = data["intra_node"]
    table.add_row("link bandwidth (all-reduce fit)", si(link["bandwidth_bytes_per_s"], "B/s"))
    table.add_row("link latency", f"{link['latency_s'] * 1e6:.1f} us")
    table.add_row("optimizer step", si(data["host"]["cpu_adam_params_per_s"], "params/s"))
    table.add_row("memory", binary_bytes(data["memory_bytes"]))
    if "op_times" in data:
        meta = data["metadata"]
        table.add_row(f"ops of {meta['op_times_model']} timed", f"{meta['op_times_measured']} "
                      f"(+{meta['op_times_skipped']} kept on the roofline)")
    Console().print(table)
    Console().print(f"wrote {out}")
