"""Helpers for the tests that start real worker processes through ``tensoropt launch``."""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
from conftest import EXAMPLES, LAUNCH_CWD, REPO

from launcher.argv import torchrun_argv
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

GPT_SCRIPT = str(EXAMPLES / "train_gpt.py")
# two workers, two cores: one thread each. The suite compares launched runs with the script run alone at float32
# tolerances: both run in 32-true (the launcher's default precision and the script alone's, see
# runtime.engines.precision); tests of the other precisions name theirs (tests/test_precision.py)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TENSOROPT_PRECISION": "32-true"}


ADAMW_LR = 1e-3             # examples/train_gpt.py's AdamW
# A launched run's float32 losses against the script's alone, a few steps in (every loss comparison of the suite).
# Why 2e-5, on any CPU: the step-0 loss differs only by the order of its reductions (the launched run splits the
# batch, the sequence or the vocabulary and sums the shards; AVX2 and AVX-512 kernels sum in different orders too):
# a cross-entropy over V classes and B x T tokens sums ~B*T*V terms, each rounding adds ~eps = 6e-8 relative, and
# pairwise/blocked sums keep it to ~log2(n) eps, 1e-6 at most here. Later losses inherit the weights' deviation
# (``assert_weights_alike``: ~1e-5 of lr per weight per step, with AdamW's lr 1e-3 and the weights' gradients of size
# ~loss / n_weights), which moves the loss by less than the rounding itself over these 3-6 step runs. 2e-5 is ~10x
# what the comparison accumulates (every loss comparison held on AMD EPYC / AVX2 and Intel Xeon / AVX-512 CI machines,
# issue 34); a wrong shard or a missed reduction moves the loss by 1e-3 or more.
LOSS_RTOL = 2e-5
BULK_RTOL, BULK_ATOL = 2e-5, 1e-5
OUTLIER_SHARE = 1e-3


def assert_weights_alike(got, want, steps: int, lr: float = ADAMW_LR) -> None:
    """A launched run's final float32 weights against the script's alone, after ``steps`` AdamW steps.

    Why these tolerances, on any CPU (AVX2 or AVX-512 sum in different orders, and the launched run splits the
    batch and sums shards): each gradient differs from the script's by float32 roundings of its reductions, a few
    hundred eps of its size at most here (~1e-5 relative). AdamW moves a weight by lr * m / sqrt(v): about lr whatever
    the gradient's size (at most ~1.05 lr in the first steps, where the bias-corrected moments hold one to three
    gradients). A weight whose gradient is well above its rounding noise moves the same to ~1e-5 of lr per step: the
    bulk is within ``BULK_RTOL`` relative and ``BULK_ATOL`` absolute (100x below lr). A weight whose gradient is
    itself near the noise (a bias or norm weight whose gradient nearly cancels) may move by up to lr either way in
    each step, whichever rounding it got: at most ``OUTLIER_SHARE`` of the weights may leave the bulk tolerance, and
    none by more than 2 lr per step."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    deviation = np.abs(got - want)
    outside = deviation > BULK_ATOL + BULK_RTOL * np.abs(want)
    assert outside.mean() <= OUTLIER_SHARE, \
        f"{outside.sum()} of {got.size} weights outside the bulk tolerance (largest deviation {deviation.max():.3g})"
    assert deviation.max() <= 2 * lr * steps, f"a weight moved {deviation.max():.3g} from the script's alone"


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` of a process a test interrupts with SIGINT: Ctrl-C as a terminal delivers it. A suite started in
    the background of a shell without job control (``cmd &`` in a script, as CI runners and ``nohup`` may) hands
    every process below it SIGINT ignored, and Python keeps an ignored SIGINT ignored: the interrupt would be lost
    and the test would measure how the suite was started, not the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tensoropt_cli(*args, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensoropt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env or ENV, timeout=600)


def probe_under_torchrun(script: str, tmp_path) -> dict:
    """What rank 0 of ``tests/SCRIPT`` wrote (JSON, to the file its first argument names) when run by torchrun on two
    CPU workers in ``tmp_path``: the probes that check a runtime mechanism on real process groups."""
    out = tmp_path / "probe.json"
    result = subprocess.run(torchrun_argv(str(REPO / "tests" / script), [str(out)], 2), env=ENV, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


_ALONE: dict[tuple, list[float]] = {}


def losses_alone(script, out, *args, steps: int = 3, precision: str = "32-true") -> list[float]:
    """The script run by hand in ``precision``: one process, no plan; its per-step losses. Run once per test process
    for one (script, arguments, steps, precision): the reference of several modules (``out`` is the first caller's;
    a path among ``args`` keeps a run its caller's own)."""
    key = (str(script), tuple(map(str, args)), steps, precision)
    if key not in _ALONE:
        subprocess.run([sys.executable, script, "--steps", str(steps), "--out", out, *map(str, args)], check=True,
                       env={**ENV, "TENSOROPT_PRECISION": precision}, capture_output=True, timeout=300)
        _ALONE[key] = json.loads(out.read_text())["losses"]
    return list(_ALONE[key])


_DRY_RUNS: dict[tuple, tuple[Plan, str]] = {}


def dry_run_plan(script, run_dir, devices: int = 2, *script_args) -> Plan:
    """The plan the launcher chooses for ``devices`` CPU workers (nothing started): a starting point
    that tests edit into the plans they run with ``--plan``. One dry run per test process for one (script, devices,
    arguments): five modules start from GPT's 2-device plan, and the launcher's choice depends on nothing else
    (``run_dir`` holds the first caller's run)."""
    return chosen_plan(script, run_dir, devices, *script_args)[0]


def chosen_plan(script, run_dir, devices: int = 2, *script_args, options: tuple = ()) -> tuple[Plan, str]:
    """``dry_run_plan`` under the launcher's ``options`` (``--objective min-memory``, ``--tp 2``): the plan it
    chooses and the engine it chooses for it, once per test process for one (script, devices, arguments, options)."""
    key = (str(script), devices, tuple(map(str, script_args)), tuple(map(str, options)))
    if key not in _DRY_RUNS:
        result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", devices, *options, "--run-dir", run_dir,
                               "--dry-run", "--", *script_args, cwd=LAUNCH_CWD)
        assert result.returncode == 0, result.stderr[-2000:]
        written = json.loads((run_dir / "plan.json").read_text())
        _DRY_RUNS[key] = Plan.from_json(written), written["engine"]
    return _DRY_RUNS[key]


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
                       engine: str = "torch", memory: bool = False, params: bool = False) -> dict:
    """What rank 0 of ``script --steps 3 *script_args`` wrote when launched on ``devices`` CPU workers with
    ``plan`` given by ``--plan`` on ``engine``, checked to have run that plan there; with the launcher's output
    (``"stdout"``) and the plan.json it handed the workers (``"written"``). With ``memory``, every rank tracks its
    steps' tensor memory (``TENSOROPT_MEMORY_OUT``) and rank 0's record is ``"memory"``; with ``params``, the final
    parameters the script saves (``--save-params``, gathered, flattened) are ``"params"``. Launched from the test
    process's ``LAUNCH_CWD`` (conftest), every path given absolute."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    env = ENV | {"TENSOROPT_MEMORY_OUT": str(tmp_path / "memory-{rank}.json")} if memory else ENV
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", devices, "--plan", path, "--engine", engine,
                           "--run-dir", tmp_path / "run", "--", "--steps", 3, "--out", tmp_path / "losses.json",
                           *(("--save-params", tmp_path / "params.npy") if params else ()), *script_args,
                           cwd=LAUNCH_CWD, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "losses.json").read_text())
    assert (data["plan"], data["engine"]) == (plan.summary(), engine)
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    # an engine whose step the tracker does not wrap (runtime.memory.check.measuring) writes no record: None
    record = tmp_path / "memory-0.json"
    extra = {"memory": json.loads(record.read_text()) if record.exists() else None} if memory else {}
    if params:
        extra["params"] = np.load(tmp_path / "params.npy")
    return data | {"stdout": result.stdout, "written": written} | extra


_LAUNCHED: dict[str, dict] = {}


def launched_once(plan: Plan, tmp_path, script: str = GPT_SCRIPT, *script_args: str, engine: str = "torch") -> dict:
    """``launched_with_plan`` on ``plan.devices`` workers with memory tracked and parameters saved, run once per test
    process for one (plan, script, arguments, engine): tests that assert different things of the same launch share
    it instead of launching it again (tests/test_memory_check.py reads the memory of runs whose losses
    tests/test_launch.py and tests/test_precision.py check). Each caller still launches it when run alone. Callers
    share one xdist group (tests/conftest.py: SHARED_LAUNCHES), so under ``pytest -n 2`` one process runs them all
    and the sharing holds there too. A path in ``script_args`` would make every launch unique: pass only values."""
    key = json.dumps([plan.to_json(), str(script), [str(a) for a in script_args], engine], sort_keys=True)
    if key not in _LAUNCHED:
        _LAUNCHED[key] = launched_with_plan(plan, tmp_path, plan.devices, script, *script_args, engine=engine,
                                            memory=True, params=True)
    return _LAUNCHED[key]


def gpt_plan(*, dp: int = 2, tp: int = 1, zero: int = 0, micro_batch: int, recompute: str = "none", sp: bool = False,
             precision: str = "32-true", layers: int = 4, grad_dtype: str = "") -> Plan:
    """A 2-device plan of examples/train_gpt.py's model (one block of ``layers`` copies, one strategy) at its global
    batch of 8: the plans that tests in several modules launch and share through ``launched_once``."""
    return Plan(devices=2, dp=dp, tp=tp, pp=1, micro_batch=micro_batch, global_batch=8, zero=zero,
                tp_branches=("attn", "mlp") if tp > 1 else (), precision=precision,
                dtype="bfloat16" if precision == "bf16-mixed" else "float32", master_weights=False,
                grad_dtype=grad_dtype, blocks=(BlockPlan("layers.*", ((LayerStrategy(recompute, sp), layers),)),))
