"""``launch --dry-run --check-memory``: rank 0's step simulated on fake tensors holds what the real run holds.

Each slow case writes one plan, simulates it through the launcher (``--check-memory``, one process, nothing
allocated), then trains it for real on two CPU workers with ``TENSOROPT_MEMORY_OUT``, which tracks the same
steps with the same tracker, and compares rank 0's peak tensor bytes. The real runs go through
``workers.launched_once``: where another test launches the same plan (the DDP case is tests/test_launch.py's DDP run,
ZeRO 3 in bf16-mixed tests/test_precision.py's), the one launch serves both."""

import json

import pytest
import torch
from workers import GPT_SCRIPT, gpt_plan, launched_once, tensoropt_cli

from tensoropt.runtime.memory_check import unsimulated
from tensoropt.runtime.memory_tracker import StepMemory
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

RELATIVE = 0.02          # "within a few percent"; the cases below agree to 0.3% or within 1 KiB


def test_tracker_counts_live_storages_once_and_names_their_roles():
    """A view adds nothing, a freed tensor leaves the count, the peak is kept with what was live at it, and a
    storage registered as a parameter is counted under parameters."""
    weight = torch.zeros(1000)                               # 4000 bytes, made before tracking
    tracker = StepMemory()
    tracker.register("parameters", [weight])
    with tracker:
        a = torch.ones(500)                                  # 2000 bytes, forward: an activation
        view = a[:10]
        b = a * 2                                            # 2000 more: peak 8000
        del a, view, b
        c = torch.ones(250)                                  # 1000 after the peak
    assert tracker.peak_bytes == 8000
    assert tracker.live_bytes == 5000 and c.numel() == 250
    assert tracker.breakdown() == {"parameters": 4000, "gradients": 0, "optimizer": 0, "activations": 4000,
                                   "temporaries": 0, "peak_bytes": 8000}


def test_pipelines_and_deepspeed_are_said_to_be_unsimulated():
    blocks = (BlockPlan("layers.*", ((LayerStrategy(), 2),)),)
    pipeline = Plan(devices=2, dp=1, tp=1, pp=2, micro_batch=1, global_batch=2, blocks=blocks)
    flat = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=1, global_batch=2, blocks=blocks)
    assert "pipeline" in unsimulated(pipeline, "torch")
    assert "deepspeed" in unsimulated(flat, "deepspeed")
    assert unsimulated(flat, "torch") is None


def test_check_memory_needs_dry_run(tmp_path):
    result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--check-memory", cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --check-memory simulates the plan instead of running it: add --dry-run")


def _plan(*, dp=2, micro_batch=None, **change) -> Plan:
    """A plan for examples/train_gpt.py's model on 2 devices: by default 4 copies and a global batch of 8 in two
    micro-batches per rank (gradient accumulation exercised)."""
    return gpt_plan(dp=dp, micro_batch=micro_batch or 8 // dp // 2, **change)


CASES = {
    "ddp": dict(zero=0),
    "fsdp-zero1-bf16-mixed": dict(zero=1, precision="bf16-mixed"),
    "fsdp-zero3-full-recompute": dict(zero=3, recompute="full"),
    "tp2": dict(dp=1, tp=2),
    "tp2-sp-selective": dict(dp=1, tp=2, sp=True, recompute="selective"),
    # a known gap, the same bytes every run: with 4 copies in 2 micro-batches the simulation held 133,376 bytes (4.8%)
    # less than the real run (2,639,708 vs 2,773,084; with selective recomputation 2,590,556 vs 2,723,932); run here
    # as tests/test_precision.py's bf16-mixed ZeRO 3 run (2 copies, one micro-batch), 104,448 bytes (6.1%) less
    # (1,608,184 vs 1,712,632). ZeRO 3 in 32-true and ZeRO 1 in bf16-mixed agree to 1 KiB. Cause not found (gloo's
    # bf16 all-gather, FSDP2's casts: open).
    "fsdp-zero3-bf16-mixed": dict(zero=3, precision="bf16-mixed", layers=2, micro_batch=4),
}
GAPS = {"fsdp-zero3-bf16-mixed": "simulated 6.1% below the real run (open)"}


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=GAPS[c])) if c in GAPS
                                  else c for c in CASES])
def test_simulated_peak_equals_the_real_runs(tmp_path, case):
    """The simulated peak of rank 0's second step is within 2% of the real run's (same tracker), and the
    optimizer states at the peak are the same bytes; the launcher prints both beside the prediction."""
    plan = _plan(**CASES[case])
    script_args = ("--layers", str(CASES[case]["layers"])) if "layers" in CASES[case] else ()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", path, "--precision",
                           plan.precision, "--run-dir", tmp_path / "sim", "--dry-run", "--check-memory", "--",
                           *script_args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "simulated / predicted" in result.stdout
    check = json.loads((tmp_path / "sim" / "memory_check.json").read_text())
    assert check["plan"] == plan.summary() and check["simulated"]["simulated"] is True
    measured = launched_once(plan, tmp_path, GPT_SCRIPT, *script_args)["memory"]
    simulated = check["simulated"]
    assert measured["simulated"] is False and measured["peak_bytes"] > 0
    assert simulated["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=RELATIVE)
    assert simulated["optimizer"] == measured["optimizer"]
