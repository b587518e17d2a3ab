"""tensoropt launch on CPU: real torchrun workers over gloo, compared with the same script run alone."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLES, ISOLATED, LAUNCH_CWD
from workers import ENV, GPT_SCRIPT, LOSS_RTOL, launched_once, losses_alone, tensoropt_cli

from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

pytestmark = [pytest.mark.slow]   # the tests that start workers share the "multiprocess" xdist group
SCRIPT = GPT_SCRIPT


@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    """A dry run: the plan the launcher chooses for 2 CPU workers, nothing started; returned as the
    2-way data-parallel plan of the same model that the tests edit into the plans they run."""
    run_dir = tmp_path_factory.mktemp("dry")
    result = tensoropt_cli("launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--run-dir", run_dir, "--dry-run", "--",
                       "--steps", 3, "--out", run_dir / "never.json", cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "chosen: " in result.stdout and "launcher.torchrun --nproc-per-node 2" in result.stdout
    assert "predicted: " in result.stdout and ("torch: " in result.stdout or "deepspeed config: " in result.stdout)
    assert not (run_dir / "never.json").exists()                     # nothing trained
    plan = Plan.from_json(json.loads((run_dir / "plan.json").read_text()))
    assert plan.devices == 2
    return dataclasses.replace(plan, dp=2, tp=1, pp=1, virtual_stages=1, zero=0, offload=False, micro_batch=4,
                               tp_branches=(), blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 4),)),))


def _run_plan(plan: Plan, tmp_path, engine: str, *script_args: str):
    if engine == "torch":       # shared: tests/test_memory_check.py reads the memory of the DDP run
        return launched_once(plan, tmp_path, SCRIPT, *script_args)["losses"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", path, "--engine", engine,
                       "--run-dir", tmp_path / "run", "--", "--steps", 3, "--out", tmp_path / "losses.json",
                       *script_args, cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "losses.json").read_text())
    assert (data["plan"], data["engine"]) == (plan.summary(), engine)
    return data["losses"]


def _with(plan: Plan, zero: int, micro_batch: int, full_recompute: int, offload: bool = False) -> Plan:
    strategies = tuple((LayerStrategy(r), n) for r, n in (("full", full_recompute), ("none", 4 - full_recompute)) if n)
    return dataclasses.replace(plan, zero=zero, micro_batch=micro_batch, offload=offload,
                               blocks=(BlockPlan("layers.*", strategies),))


# the script's --local-data: each rank passes only its rows of the global batch (run.local_rows(), local=True) and
# reads the loss back only when it logs (sync=False): the same losses
LOCAL = ("--local-data", "--log-every", "2")


@pytest.mark.parametrize("engine, zero, micro_batch, full_recompute, offload, script_args", [
    # DDP, 2 accumulation steps: also tests/test_memory_check.py's DDP case (one launch); DDP in one micro-batch is
    # tests/test_precision.py's DDP runs (32-true: test_32_true_trains_a_bf16_built_model_in_float32)
    ("torch", 0, 2, 0, False, ()),
    # FSDP2 without resharding (ZeRO 2), 2 accumulation steps, 2 of 4 layers recomputed, the script's rows only
    ("torch", 2, 2, 2, False, LOCAL),
    # FSDP2 (ZeRO 3), 4 accumulation steps, every layer recomputed (dp2 mb1x4 zero3 [4xfull]): the plan node 0
    # chooses and both nodes run in test_two_nodes_on_localhost_run_node_0s_plan, against the same reference
    ("deepspeed", 1, 2, 2, False, ()),  # ZeRO 1, 2 accumulation steps, deepspeed.checkpointing on 2 of 4 layers
    ("deepspeed", 2, 4, 0, True, ()),   # ZeRO 2 with the optimizer offloaded
    ("deepspeed", 3, 1, 4, False, LOCAL),  # ZeRO 3, 4 accumulation steps, every layer recomputed, the rows only
])
@pytest.mark.xdist_group("multiprocess")
def test_two_workers_match_one_process(reference, chosen, tmp_path, engine, zero, micro_batch, full_recompute,
                                       offload, script_args):
    losses = _run_plan(_with(chosen, zero, micro_batch, full_recompute, offload), tmp_path, engine, *script_args)
    np.testing.assert_allclose(losses, reference, rtol=LOSS_RTOL)
    if engine == "deepspeed":                                  # the config it trained with is kept for the user
        config = json.loads((tmp_path / "run" / "deepspeed.json").read_text())
        assert config["zero_optimization"]["stage"] == zero
        assert config["gradient_accumulation_steps"] == 4 // micro_batch
        assert ("offload_optimizer" in config["zero_optimization"]) == offload
        # DeepSpeed compiled no C++ op on its way (its shared-memory all-reduce serves inference only: a ~60 s gcc
        # run at a machine's first start; runtime.engines.deepspeed_engine.skip_inference_all_reduce_op)
        assert not list(Path(ISOLATED["TORCH_EXTENSIONS_DIR"]).iterdir())


def test_bad_input_is_one_line(chosen, tmp_path):
    (tmp_path / "crash.py").write_text("raise SystemExit('out of data')\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(chosen.to_json()))
    zero1 = tmp_path / "zero1.json"
    zero1.write_text(json.dumps(dataclasses.replace(chosen, zero=1, offload=True).to_json()))
    compiled = tmp_path / "compiled.json"
    compiled.write_text(json.dumps(dataclasses.replace(chosen, compile=True, offload=False, blocks=(
        BlockPlan("layers.*", ((LayerStrategy("selective"), 4),)),)).to_json()))
    tp2 = tmp_path / "tp2.json"
    tp2.write_text(json.dumps(dataclasses.replace(chosen, dp=1, tp=2, micro_batch=8, tp_branches=("attn",)).to_json()))
    cases = [
        (["launch", tmp_path / "missing.py", "--device", "cpu", "--gpus", 2], "no such script"),
        (["launch", tmp_path / "crash.py", "--device", "cpu", "--gpus", 2], "failed while TensorOpt captured"),
        (["launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--mem-per-gpu", "1KiB", "--dry-run"],
         "the least memory any plan needs"),
        (["launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", plan, "--dry-run", "--", "--layers", 2],
         "is not a plan for this model"),
        (["launch", SCRIPT, "--gpus", 2], "no GPU found on this machine"),
        (["launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", compiled, "--dry-run"],
         # the engine it names
         "needs compiled blocks with selective recomputation, which the torch engine does not apply\n"),
        (["launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", zero1, "--engine", "torch", "--dry-run"],
         "needs optimizer offload, which the torch engine does not apply"),
        (["launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", tp2, "--engine", "deepspeed", "--dry-run"],
         "needs tensor parallelism, which the deepspeed engine does not apply"),
    ]
    for args, expected in cases:      # paths absolute: from the folder whose captures the other launches share
        result = tensoropt_cli(*args, cwd=LAUNCH_CWD)
        assert result.returncode == 1, (args, result.stderr[-500:])
        assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr[-500:]


def test_dry_run_reuses_the_capture_for_other_steps_until_a_source_or_the_model_changes(tmp_path):
    """The capture is cached by the script's sources and the arguments it read (launcher.capture_index): a launch
    with another --steps or --out does not run the script again, one with another --layers does."""
    script = tmp_path / "train.py"
    counter = tmp_path / "captures.txt"
    source = (EXAMPLES / "train_gpt.py").read_text()
    script.write_text(f"open({str(counter)!r}, 'a').write('x')\n" + source)
    env = {**ENV, "TENSOROPT_CACHE_DIR": str(tmp_path / "cache")}

    def dry_run(*extra):
        result = subprocess.run([sys.executable, "-m", "tensoropt", "launch", str(script), "--device", "cpu", "--gpus",
                                 "2", "--dry-run", "--run-dir", str(tmp_path / "run"), *extra], capture_output=True,
                                text=True, cwd=tmp_path, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.splitlines()[0], counter.read_text().count("x")
    first = dry_run()
    assert dry_run() == (first[0], 1)                            # same plan, the script was not run again
    assert dry_run("--no-cache")[1] == 2
    script.write_text(script.read_text() + "# edited\n")
    assert dry_run()[1] == 3                                     # an edited script is captured again
    assert dry_run("--", "--steps", "9", f"--out={tmp_path / 'losses.json'}") == (first[0], 3)   # not read by it
    assert dry_run("--", "--layers", "2", "--steps", "9")[1] == 4                                # another model


@pytest.mark.xdist_group("multiprocess")
def test_hugging_face_llama_script_launches_on_two_workers(tmp_path):
    script = str(EXAMPLES / "train_llama_hf.py")
    alone = losses_alone(script, tmp_path / "alone.json")
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", 2, "--run-dir", tmp_path / "run", "--",
                       "--steps", 3, "--out", tmp_path / "launched.json", cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    launched = json.loads((tmp_path / "launched.json").read_text())
    assert launched["plan"] and launched["engine"] in ("torch", "deepspeed")     # ran under the chosen plan
    np.testing.assert_allclose(launched["losses"], alone, rtol=LOSS_RTOL)


def _two_free_ports() -> int:
    """A port P with P + 1 free too: torchrun's rendezvous takes P, node 0 shares its plan on P + 1."""
    import socket
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


@pytest.mark.xdist_group("multiprocess")
def test_two_nodes_on_localhost_run_node_0s_plan(reference, tmp_path):
    """Two launchers as node ranks 0 and 1 of one job. Left to itself node 1 would choose another plan (its
    objective differs); it runs node 0's, shared through the rendezvous, and the job trains as one."""
    port = _two_free_ports()
    common = ["launch", SCRIPT, "--device", "cpu", "--gpus", 1, "--nnodes", 2, "--master-addr", "127.0.0.1",
              "--master-port", port, "--engine", "torch"]
    node1 = subprocess.Popen([sys.executable, "-m", "tensoropt", *map(str, common), "--node-rank", "1", "--run-dir",
                              str(tmp_path / "node1"), "--", "--steps", "3"], cwd=LAUNCH_CWD, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node0 = tensoropt_cli(*common, "--objective", "min-memory", "--node-rank", 0, "--run-dir", tmp_path / "node0",
                          "--", "--steps", 3, "--out", tmp_path / "losses.json", cwd=LAUNCH_CWD)
    out1, err1 = node1.communicate(timeout=300)
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, err1[-3000:]
    plans = [json.loads((tmp_path / node / "plan.json").read_text()) for node in ("node0", "node1")]
    summaries = [Plan.from_json(plan).summary() for plan in plans]
    assert summaries[0] == summaries[1] == "dp1 tp1 pp2 mb1x8 zero0 [2xfull]"     # node 0's min-memory choice
    assert plans[1]["predicted"]["why"].startswith(f"node 0's plan, shared at 127.0.0.1:{port + 1}")
    assert "chosen: dp1 tp1 pp2 mb1x8 zero0 [2xfull] (engine torch)" in out1
    data = json.loads((tmp_path / "losses.json").read_text())
    assert (data["plan"], data["engine"]) == (summaries[0], "torch")
    np.testing.assert_allclose(data["losses"], reference, rtol=LOSS_RTOL)


def test_multi_node_launches_need_the_master_address(tmp_path):
    cases = [(["--nnodes", 2], r"^error: --nnodes 2 needs --master-addr: the address of node 0"),
             (["--nnodes", 2, "--node-rank", 2, "--master-addr", "127.0.0.1"], r"^error: --node-rank 2 must be below "
                                                                              r"--nnodes 2\n$")]
    for flags, message in cases:
        result = tensoropt_cli("launch", SCRIPT, "--device", "cpu", "--gpus", 1, *flags, "--run-dir", tmp_path / "r",
                               "--", "--steps", 3, cwd=LAUNCH_CWD)
        assert result.returncode == 1 and re.match(message, result.stderr), result.stderr[-2000:]
        assert "Traceback" not in result.stderr and not (tmp_path / "r").exists()
    dry = tensoropt_cli("launch", SCRIPT, "--device", "cpu", "--gpus", 1, "--nnodes", 2, "--dry-run", "--run-dir",
                        tmp_path / "dry", "--", "--steps", 3, cwd=LAUNCH_CWD)      # a dry run plans without a master
    assert dry.returncode == 0 and Plan.from_json(json.loads((tmp_path / "dry" / "plan.json").read_text())).devices == 2


def test_a_node_without_node_0_stops_in_one_line(tmp_path):
    port = _two_free_ports()
    result = tensoropt_cli("launch", SCRIPT, "--device", "cpu", "--gpus", 1, "--nnodes", 2, "--node-rank", 1,
                           "--master-addr", "127.0.0.1", "--master-port", port, "--run-dir", tmp_path / "r", "--",
                           "--steps", 3, cwd=LAUNCH_CWD, env=ENV | {"TENSOROPT_PLAN_TIMEOUT_S": "2"})
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith(f"error: node 1 got no plan from node 0 at 127.0.0.1:{port + 1} within 2 s")
    assert "give every node the same --plan" in result.stderr and not (tmp_path / "r").exists()
