"""``tensoropt launch --dry-run --check-memory``: the chosen plan's step simulated for rank 0, beside the prediction.

The script runs once more as a capture does (one process, every tensor on the meta device, see
``tensoropt.runtime.capture_run``), now with the plan and ``TENSOROPT_SIMULATE_MEMORY``: ``tensoropt.parallelize``
applies the plan through the torch engine on fake tensors and a fake process group and tracks two steps
(``tensoropt.runtime.memory.check``). The peak tensor bytes of the second step, by category, are printed next to
the cost model's breakdown of the same plan and written to ``memory_check.json`` in the run directory.

The prediction's ``other`` holds the largest transient working set, the autocast's weight copies and the
profile's ``runtime_overhead_bytes`` (CUDA context, communication libraries, the allocator's fragmentation),
which no tensor count sees: it is shown as its own line and left out of the predicted tensor total.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from tensoropt.cost.model import estimate
from tensoropt.errors import TensorOptError
from tensoropt.graph.cache import write_json_atomic
from tensoropt.runtime import CAPTURE_ENV, PLAN_ENV
from tensoropt.search.ft import FrontierPoint

from .argv import capture_argv
from .devices import Devices

ROWS = (("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"), ("optimizer", "optimizer_bytes"),
        ("activations", "activations_bytes"), ("temporaries", "transient_bytes"))


def simulate_script(script: str, script_args: list[str], plan_file: Path, timeout_s: float = 600) -> dict:
    """Rank 0's simulated step of the plan in ``plan_file`` (``memory.check.simulate``), run in one process."""
    from tensoropt.runtime.memory.check import SIMULATE_ENV  # with torch: only when a plan is simulated
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "memory.json"
        env = {**os.environ, PLAN_ENV: str(plan_file.resolve()), SIMULATE_ENV: str(out)}
        env.pop(CAPTURE_ENV, None)
        try:
            result = subprocess.run(capture_argv(script, script_args), env=env, capture_output=True, text=True,
                                    timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TensorOptError(f"the memory check of {script} took over {timeout_s:.0f} s") from exc
        if not out.exists():
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise TensorOptError(f"the memory check of {script} failed: {last}")
        return json.loads(out.read_text())


def predicted_breakdown(model, point: FrontierPoint, overhead_bytes: int) -> dict:
    """The cost model's memory of ``point``'s plan by the tracker's categories: ``other`` less the runtime
    overhead is the transient working set and the autocast copies (``temporaries``)."""
    parts = estimate(model, point.plan).memory_breakdown
    return parts | {"transient_bytes": parts["other_bytes"] - overhead_bytes, "runtime_overhead_bytes": overhead_bytes,
                    "tensor_bytes": point.peak_memory_bytes - overhead_bytes}


def _gib(n: float) -> str:
    return f"{n / 2**30:9.3f} GiB"


def report_lines(simulated: dict, predicted: dict) -> list[str]:
    """The comparison, one line per category (GiB; the ratio simulated / predicted)."""
    lines = [f"  {'':13s} {'simulated':>13s} {'predicted':>13s}"]
    for name, key in ROWS:
        lines.append(f"  {name:13s} {_gib(simulated[name])} {_gib(predicted[key])}")
    ratio = simulated["peak_bytes"] / predicted["tensor_bytes"] if predicted["tensor_bytes"] > 0 else float("nan")
    lines.append(f"  {'tensors, peak':13s} {_gib(simulated['peak_bytes'])} {_gib(predicted['tensor_bytes'])}"
                 f"   (simulated / predicted {ratio:.3f})")
    lines.append(f"  {'+ runtime':13s} {'':13s} {_gib(predicted['runtime_overhead_bytes'])}   (CUDA context, "
                 "libraries, fragmentation: not tensors, not simulated)")
    return lines


SHOWN_LARGEST = 5          # of the largest tensors at the simulated peak, the ones printed (memory_check.json: all)


def largest_lines(largest: list[dict]) -> list[str]:
    """The largest tensors live at the simulated peak, one line each (what a gap to the prediction is made of)."""
    if not largest:
        return []
    lines = [f"  largest tensors at the peak ({len(largest)} in memory_check.json):"]
    for t in largest[:SHOWN_LARGEST]:
        what = f"{(t['dtype'] or '').removeprefix('torch.')} {t['shape']}" if t["shape"] is not None else "a tensor"
        made = f"{what} from {t['op']}" if t["op"] else f"{what} made before the step"
        lines.append(f"    {t['bytes'] / 2**20:10.1f} MiB  {t['category']:11s} {made}")
    return lines


def simulate_and_compare(script: str, script_args: list[str], plan_file: Path, engine: str, model, point: FrontierPoint,
                 devices: Devices, echo: Callable[[str], object]) -> dict | None:
    """Simulate the plan written to ``plan_file`` and print it beside the prediction (module doc); the plan's
    engine or layout that cannot be simulated is said in one line and skipped (None)."""
    from tensoropt.runtime.memory.check import unsimulated
    plan = point.plan
    if reason := unsimulated(plan, engine):
        echo(f"memory check: skipped: {reason}")
        return None
    simulated = simulate_script(script, script_args, plan_file)
    largest = simulated.pop("largest_at_peak", [])
    predicted = predicted_breakdown(model, point, devices.profile.runtime_overhead_bytes)
    echo(f"memory check: rank {simulated['rank']}'s second step simulated on fake tensors (torch engine, fake process "
         f"group of {plan.devices}), peak tensor memory by category:")
    for line in report_lines(simulated, predicted) + largest_lines(largest):
        echo(line)
    result = {"plan": plan.summary(), "simulated": simulated, "predicted": predicted, "largest_at_peak": largest}
    write_json_atomic(plan_file.parent / "memory_check.json", result)
    return result


__all__ = ["largest_lines", "predicted_breakdown", "report_lines", "simulate_and_compare", "simulate_script"]
