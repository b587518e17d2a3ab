"""Where a worker trains, tested through the code every worker runs: the device a plan asks for, batches
moved there, and anything elsewhere refused in one line. ``meta`` stands in for a second device: moving
to it and comparing devices is all the logic needs, on any machine."""

import dataclasses

import pytest
import torch
from torch import nn

import tensoropt
from launcher.devices import Devices, detect
from launcher.launch import plan_for
from tensoropt.cost.profile import load_profile
from tensoropt.errors import TensorOptError
from tensoropt.runtime.device import check_placement, misplaced, to_device, worker_device
from tensoropt.runtime.run import Run
from tensoropt.space.plan import Plan
from tensoropt.space.run_plan import RunPlan

META, CPU = torch.device("meta"), torch.device("cpu")


def test_batches_of_every_shape_move_to_the_device():
    batch = {"input_ids": torch.ones(4, 3), "extra": (torch.zeros(4), [torch.ones(2)], "text", 3)}
    moved = to_device(batch, META)
    assert moved["input_ids"].is_meta and moved["extra"][0].is_meta and moved["extra"][1][0].is_meta
    assert moved["extra"][2:] == ("text", 3) and isinstance(moved["extra"], tuple)


def test_a_run_hands_the_engine_this_ranks_micro_batches_on_its_device():
    run = Run(dp_rank=1, dp_size=2, grad_accumulation=2, device=META)
    tokens = torch.arange(16).reshape(8, 2)
    micro = run.local_batches((tokens, tokens + 1))
    assert [m[0].shape for m in micro] == [(2, 2), (2, 2)] and all(m[0].is_meta and m[1].is_meta for m in micro)


def test_a_parameter_off_the_device_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    check_placement(model, CPU, "here")                                          # all on the CPU: fine
    assert misplaced(model.named_parameters(), torch.device("cuda", 0)) == [
        "0.weight (cpu)", "0.bias (cpu)", "1.weight (cpu)", "1.bias (cpu)"]
    model[1].to(META)
    with pytest.raises(TensorOptError, match=r"^here: 1.weight \(meta\), 1.bias \(meta\) not on cpu, where the plan "
                                             r"trains"):
        check_placement(model, CPU, "here")


def test_train_step_refuses_a_model_moved_away_after_parallelize():
    model = nn.Linear(4, 1)
    _, _, run = tensoropt.parallelize(model, lambda p: torch.optim.SGD(p, lr=0.1), example_inputs=torch.ones(1, 4),
                                      global_batch=2)
    run.plan, run.device = _run_plan("cuda"), torch.device("cuda", 0)              # as a GPU worker's run
    with pytest.raises(TensorOptError, match="weight .cpu., bias .cpu. not on cuda:0"):
        run.train_step(torch.ones(2, 4))


def _run_plan(device: str) -> RunPlan:
    return RunPlan(Plan(devices=1, dp=1, tp=1, pp=1, micro_batch=1, global_batch=1), device=device)


def test_the_plan_names_the_device_kind():
    assert worker_device(_run_plan("cpu")) == CPU
    with pytest.raises(TensorOptError, match="plan device 'tpu' is unknown"):
        _run_plan("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(TensorOptError, match=r"the plan trains on GPUs, but worker 0 sees 0 GPU\(s\)"):
            worker_device(_run_plan("cuda"))


def test_a_full_device_is_one_line_before_any_worker_starts(write_json):
    from conftest import SMALL_GPT

    from tensoropt.api import capture
    graph = capture(write_json("gpt.json", SMALL_GPT), batch_size=1, seq_len=32).graph
    graph = dataclasses.replace(graph, metadata=graph.metadata + (("global_batch", "8"),))
    full = Devices("cuda", 2, 2**20, load_profile("h100-80gb"), "h100-80gb", "GPU 1 has 0.0 of 80.0 GiB free "
                   "(another process holds the rest)")
    with pytest.raises(TensorOptError, match=r"^no plan fits in 0.0 GiB per device; the least memory any plan needs "
                                             r"is .* GiB \(add devices or memory\); GPU 1 has 0.0 of 80.0 GiB free"):
        plan_for(graph, full, 2, "fastest")


@pytest.mark.skipif(torch.cuda.is_available(), reason="planning for GPUs that are not there")
def test_without_gpus_only_a_dry_run_plans_for_them():
    devices = detect("cuda", 8, None, None, dry_run=True)
    assert (devices.kind, devices.count, devices.memory_bytes) == ("cuda", 8, load_profile("h100-80gb").memory_bytes)
    with pytest.raises(TensorOptError, match="no GPU found on this machine"):
        detect("cuda", 8, None, None, dry_run=False)
    with pytest.raises(TensorOptError, match="no GPU found on this machine"):
        detect(None, None, None, None)
