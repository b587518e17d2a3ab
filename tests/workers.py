"""Helpers for the tests that start real worker processes through ``tensoropt launch``."""

import dataclasses
import json
import os
import subprocess
import sys

from conftest import EXAMPLES

from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

GPT_SCRIPT = str(EXAMPLES / "train_gpt.py")
# two workers, two cores: one thread each. The suite compares launched runs with the script run alone at float32
# tolerances: both run in 32-true (the launcher's default precision and the script alone's, see runtime.precision);
# tests of the other precisions name theirs (tests/test_precision.py)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TENSOROPT_PRECISION": "32-true"}


def tensoropt_cli(*args, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensoropt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env or ENV, timeout=600)


def losses_alone(script, out, *args, steps: int = 3, precision: str = "32-true") -> list[float]:
    """The script run by hand in ``precision``: one process, no plan; its per-step losses."""
    subprocess.run([sys.executable, script, "--steps", str(steps), "--out", out, *map(str, args)], check=True,
                   env={**ENV, "TENSOROPT_PRECISION": precision}, capture_output=True, timeout=300)
    return json.loads(out.read_text())["losses"]


def dry_run_plan(script, run_dir, devices: int = 2, *script_args) -> Plan:
    """The plan the launcher chooses for ``devices`` CPU workers (nothing started): a starting point
    that tests edit into the plans they run with ``--plan``."""
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", devices, "--run-dir", run_dir, "--dry-run",
                           "--", *script_args, cwd=run_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    return Plan.from_json(json.loads((run_dir / "plan.json").read_text()))


def tp2(plan: Plan, branches: tuple[str, ...], micro_batch: int, full_recompute: int = 0) -> Plan:
    """dp1 x tp2 of a one-block model's plan; a global batch of 8 in micro-batches of ``micro_batch``, the first
    ``full_recompute`` copies recomputed."""
    (block,) = plan.blocks
    copies = sum(n for _, n in block.strategies)
    strategies = tuple((LayerStrategy(r), n) for r, n in (("full", full_recompute), ("none", copies - full_recompute))
                       if n)
    return dataclasses.replace(plan, dp=1, tp=2, pp=1, virtual_stages=1, zero=0, offload=False, tp_branches=branches,
                               micro_batch=micro_batch, global_batch=8, blocks=(BlockPlan(block.block, strategies),))


def launched_with_plan(plan: Plan, tmp_path, devices: int, script: str = GPT_SCRIPT, *script_args,
                       engine: str = "torch") -> dict:
    """What rank 0 of ``script --steps 3 *script_args`` wrote when launched on ``devices`` CPU workers with
    ``plan`` given by ``--plan`` on ``engine``, checked to have run that plan there; with the launcher's output
    (``"stdout"``) and the plan.json it handed the workers (``"written"``)."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", devices, "--plan", path, "--engine", engine,
                           "--run-dir", tmp_path / "run", "--", "--steps", 3, "--out", tmp_path / "losses.json",
                           *script_args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "losses.json").read_text())
    assert (data["plan"], data["engine"]) == (plan.summary(), engine)
    return data | {"stdout": result.stdout, "written": json.loads((tmp_path / "run" / "plan.json").read_text())}
