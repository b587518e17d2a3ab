"""Fused projections trained by real 2-worker CPU runs: each model shape users write (nanoGPT's fused ``c_attn``
read by ``chunk`` or per head, Phi-3's ``gate_up_proj``, GPT-2's ``Conv1D``) trains under tensor parallelism to the
losses of the script run alone; a plan sharding code that cannot be sharded stops in one line before any worker
starts; a wrong layout is caught before training; checkpoints of reordered projections reshard onto other plans."""

import dataclasses
import json
import os
import subprocess

import numpy as np
import pytest
from conftest import EXAMPLES, LAUNCH_CWD, REPO
from workers import ENV, LOSS_RTOL, dry_run_plan, losses_alone, tensoropt_cli, torchrun_argv, tp2

pytestmark = [pytest.mark.slow]   # the tests that start workers share the "multiprocess" xdist group
FUSED, HF = str(REPO / "tests" / "train_fused.py"), str(EXAMPLES / "train_hf.py")

CASES = {   # name: (script, its arguments, the branches tensor parallelism may shard)
    "qkv-chunk+gate-up": (FUSED, ("--attention", "chunk", "--mlp", "gate-up"), {"attn", "mlp"}),
    "qkv-per-head": (FUSED, ("--attention", "interleaved",), {"attn", "mlp"}),
    "phi3": (HF, ("--arch", "phi3", "--steps", "3"), {"mlp"}),
    "gpt2-conv1d": (HF, ("--arch", "gpt2", "--steps", "3"), {"mlp"}),
}


def launch(script, plan, tmp_path, *args, checkpoint_dir=None) -> subprocess.CompletedProcess:
    path = tmp_path / f"plan-{plan.summary().replace(' ', '_')}.json"
    path.write_text(json.dumps(plan.to_json()))
    extra = ("--checkpoint-dir", checkpoint_dir, "--checkpoint-every", 1) if checkpoint_dir else ()
    return tensoropt_cli("launch", script, "--device", "cpu", "--gpus", plan.devices, "--plan", path, "--run-dir",
                         tmp_path / "run", *extra, "--", *args, cwd=LAUNCH_CWD)


@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("case", CASES)
def test_fused_projections_train_under_the_launchers_tp2_plan_to_the_losses_alone(tmp_path, case):
    """``launch --tp 2``: the launcher's own choice among the tensor-parallel plans it offers for the model."""
    script, args, shardable = CASES[case]
    alone = losses_alone(script, tmp_path / "alone.json", *args)
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", 2, "--tp", 2, "--run-dir", tmp_path / "run",
                           "--", *args, "--out", tmp_path / "out.json", cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert written["tp"] == 2 and set(written["tp_branches"]) <= shardable
    assert {b["branch"] for branches in written["tp_layout"].values() for b in branches} == shardable
    np.testing.assert_allclose(json.loads((tmp_path / "out.json").read_text())["losses"], alone, rtol=LOSS_RTOL)


def test_a_plan_sharding_a_hard_coded_split_stops_before_any_worker(tmp_path):
    plan = tp2(dry_run_plan(FUSED, tmp_path, 2, "--attention", "split"), ("attn", "mlp"), micro_batch=4)
    result = launch(FUSED, plan, tmp_path, "--attention", "split", "--out", tmp_path / "out.json")
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "cannot shard branch 'attn' of this model" in line
    assert "h.0.attn fails: ValueError: not enough values" in line
    assert not (tmp_path / "out.json").exists()


@pytest.mark.xdist_group("multiprocess")
def test_a_wrong_layout_is_caught_before_training(tmp_path):
    """plan.json's layout with the segments of the fused gate/up projection removed (as if the analysis had
    missed them): the workers' check of the sharded block against the whole one stops them in one line."""
    args = ("--attention", "chunk", "--mlp", "gate-up")
    plan = tp2(dry_run_plan(FUSED, tmp_path, 2, *args), ("attn", "mlp"), micro_batch=4)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    dry = tensoropt_cli("launch", FUSED, "--device", "cpu", "--gpus", 2, "--plan", path, "--run-dir", tmp_path / "run",
                        "--dry-run", "--", *args, cwd=LAUNCH_CWD)
    assert dry.returncode == 0, dry.stderr
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    for branch in written["tp_layout"]["h.*"]:
        if branch["branch"] == "mlp":
            del branch["segments"]
    (tmp_path / "run" / "plan.json").write_text(json.dumps(written))
    env = {**ENV, "TENSOROPT_PLAN": str(tmp_path / "run" / "plan.json")}
    argv = torchrun_argv(FUSED, [*map(str, args), "--out", str(tmp_path / "out.json")], 2)
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert ("tensor parallelism over 2 devices changes what h.0 computes: the sharded layout of mlp "
            "(mlp.gate_up_proj -> mlp.down_proj) does not match") in result.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.xdist_group("multiprocess")
def test_checkpoints_of_reordered_projections_reshard_onto_other_plans(tmp_path):
    """2 steps under tp2 (fused projections held in segment order), 2 more resumed under FSDP2 over dp2, then 2
    more resumed under tp2 again: both ways round in three launches (one per plan change, not two per direction);
    the run continues the losses of the script run alone for 6 steps."""
    args = ("--attention", "chunk", "--mlp", "gate-up")
    alone = losses_alone(FUSED, tmp_path / "alone.json", *args, steps=6)
    sharded = tp2(dry_run_plan(FUSED, tmp_path, 2, *args), ("attn", "mlp"), micro_batch=4)
    fsdp = dataclasses.replace(sharded, dp=2, tp=1, zero=3, tp_branches=(), micro_batch=2)
    directory, losses = tmp_path / "ckpt", []          # both fused projections sharded by segments under tp2
    for plan, steps in ((sharded, 2), (fsdp, 4), (sharded, 6)):
        out = tmp_path / "out.json"
        result = launch(FUSED, plan, tmp_path, *args, "--steps", steps, "--out", out, checkpoint_dir=directory)
        assert result.returncode == 0, result.stderr[-3000:]
        losses += json.loads(out.read_text())["losses"]
        os.remove(out)
    np.testing.assert_allclose(losses, alone, rtol=LOSS_RTOL)
