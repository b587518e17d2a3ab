"""Where a step's time goes, predicted against measured, in one process: forward, backward and
optimizer, each split into matrix products and all other ops.

Measured with the thread's CPU time (``time.thread_time``), which a busy machine disturbs far less
than the wall clock (a descheduled thread does not accumulate it), and split by op with
``torch.profiler`` (self CPU time per ATen op). Predicted with the cost model's per-op times
(``tensoropt.cost.ops.op_times``) over the captured graph, at the run's micro-batch, once per
profile given (the profile alone, and with measured op times).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from tensoropt.cost.ops import OpArrays, op_times
from tensoropt.cost.profile import DeviceProfile
from tensoropt.graph.ir import OpGraph

PRODUCTS = ("addmm", "mm", "bmm")
PHASES = ("forward", "backward", "optimizer")


def predicted_ms(graph: OpGraph, profile: DeviceProfile, micro_batch: int) -> dict[str, float]:
    """Predicted forward and backward milliseconds of one micro-batch, products and the rest."""
    arrays = OpArrays.of(tuple(graph.ops), profile)
    fwd, bwd = op_times(arrays, np.ones(len(graph.ops)), micro_batch, profile)
    product = np.array([op.target.split(".")[1] in PRODUCTS for op in graph.ops])
    return {"forward products": float(1e3 * fwd[product].sum()), "forward other": float(1e3 * fwd[~product].sum()),
            "backward products": float(1e3 * bwd[product].sum()), "backward other": float(1e3 * bwd[~product].sum())}


def _phase_cpu_s(model, optimizer, batch) -> dict[str, float]:
    """Thread CPU seconds of forward, backward and optimizer step of one step."""
    clock = time.thread_time
    start = clock()
    optimizer.zero_grad(set_to_none=True)
    loss = model(*batch)
    forward = clock()
    loss.backward()
    backward = clock()
    optimizer.step()
    return {"forward": forward - start, "backward": backward - forward, "optimizer": clock() - backward}


def _self_ms_by_op(fn) -> dict[str, tuple[float, int]]:
    """(self CPU milliseconds, calls) per ATen op while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key.removeprefix("aten::"): (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.key.startswith("aten::")}


def measured_ms(model, optimizer, batch, steps: int) -> dict:
    """Phase medians over ``steps`` steps (after one warm-up), and one profiled forward and backward."""
    for _ in range(2):
        _phase_cpu_s(model, optimizer, batch)
    samples = defaultdict(list)
    for _ in range(steps):
        for phase, seconds in _phase_cpu_s(model, optimizer, batch).items():
            samples[phase].append(1e3 * seconds)
    phases = {k: statistics.median(v) for k, v in samples.items()}
    optimizer.zero_grad(set_to_none=True)
    holder = {}
    forward = _self_ms_by_op(lambda: holder.setdefault("loss", model(*batch)))
    backward = _self_ms_by_op(lambda: holder["loss"].backward())
    return {"phases": phases, "forward_ops": forward, "backward_ops": backward}


def _split(ops: dict[str, tuple[float, int]]) -> tuple[float, float]:
    products = sum(ms for name, (ms, _) in ops.items() if name in PRODUCTS)
    return products, sum(ms for _, (ms, _) in ops.items()) - products


def breakdown(args: argparse.Namespace, graph: OpGraph, profiles: dict[str, DeviceProfile], micro_batch: int,
              optimizer_s: float, steps: int = 5) -> dict:
    """Predicted (per named profile) and measured milliseconds by phase and op group for one worker
    training ``micro_batch`` samples per step (the probe's model and optimizer)."""
    import train_probe
    torch.set_num_threads(1)
    model = train_probe.build_model(args)
    optimizer = train_probe.optimizer_factory(args.adam)(model.parameters())
    inputs, targets = train_probe.synthetic_batch(args)
    got = measured_ms(model, optimizer, (inputs[:micro_batch], targets[:micro_batch]), steps)
    fwd_products, fwd_other = _split(got["forward_ops"])
    bwd_products, bwd_other = _split(got["backward_ops"])
    # the profiled passes' split, scaled to the phase medians (profiling adds its own overhead)
    fwd_scale = got["phases"]["forward"] / (fwd_products + fwd_other)
    bwd_scale = got["phases"]["backward"] / (bwd_products + bwd_other)
    measured = {"forward products": fwd_products * fwd_scale, "forward other": fwd_other * fwd_scale,
                "backward products": bwd_products * bwd_scale, "backward other": bwd_other * bwd_scale,
                "optimizer": got["phases"]["optimizer"]}
    predicted = {name: predicted_ms(graph, p, micro_batch) | {"optimizer": 1e3 * optimizer_s}
                 for name, p in profiles.items()}
    top = sorted(((ms, name, n) for name, (ms, n) in got["forward_ops"].items() if name not in PRODUCTS),
                 reverse=True)[:8]
    return {"micro_batch": micro_batch, "predicted_ms": predicted, "measured_ms": measured,
            "forward_other_top": [{"op": name, "self_ms": ms, "calls": n} for ms, name, n in top],
            "graph_ops": sorted({op.target.split(".")[1] for op in graph.ops})}


def breakdown_table(b: dict) -> str:
    names = list(b["predicted_ms"])
    lines = ["| part | measured ms | " + " | ".join(f"{n} ms | {n} / measured" for n in names) + " |",
             "|---|---:|" + "---:|---:|" * len(names)]
    for key, measured in b["measured_ms"].items():
        cells = " | ".join(f"{b['predicted_ms'][n][key]:.1f} | {b['predicted_ms'][n][key] / measured:.2f}"
                           for n in names)
        lines.append(f"| {key} | {measured:.1f} | {cells} |")
    total_m = sum(b["measured_ms"].values())
    totals = " | ".join(f"{sum(b['predicted_ms'][n].values()):.1f} | {sum(b['predicted_ms'][n].values()) / total_m:.2f}"
                        for n in names)
    lines.append(f"| **step** | {total_m:.1f} | {totals} |")
    in_graph = set(b["graph_ops"])
    top = ", ".join(f"{t['op']} {t['self_ms']:.1f} ms ({t['calls']} calls"
                    f"{'' if t['op'] in in_graph else ', not in the graph'})" for t in b["forward_other_top"])
    return "\n".join(lines) + f"\n\nLargest other forward ops (profiler self time): {top}.\n"
