"""The GPU path of the profiler, the runtime's memory peaks and the GPU benchmarks, checked on CPU
(issue 17, defects 4, 9 and 10): what runs differently on a GPU is reproduced with what torch offers
on a CPU (a gloo group declared for ``cuda`` only, the host timer) or checked on the values the GPU path
computes (datasheet figures, copy sizes, thread counts, like-with-like memory figures)."""

import contextlib
import os
import queue as queue_module
import time

import pytest
import torch
import torch.distributed as dist

from launcher.devices import Devices
from launcher.launch import main_env
from tensoropt.cost.profile import load_profile
from tensoropt.profiler import collectives
from tensoropt.profiler import run as profiler_run
from tensoropt.profiler.device import MAX_CALLS, timed
from tensoropt.profiler.run import DEFAULT_RUNTIME_OVERHEAD_BYTES, Settings, runtime_overhead_bytes, threads_per_worker
from tensoropt.runtime import run as run_module
from tensoropt.runtime.run import Run

GIB = 2**30


# --- defect 4: collective tensors on the device the group's backend serves ---------------------------------

def _probe_group(rank: int, port: int, backend: str, queue) -> None:
    """Join a 2-rank group made with ``backend``; report what a CPU tensor's all-reduce says, which device
    ``group_device`` names for the world and a subgroup, and (where CPU tensors work) ``slowest_s``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=2)
    sub = dist.new_group([0, 1])
    try:
        dist.all_reduce(torch.ones(1))
        error = ""
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    # the worker runs on the CPU and asks the group where its collectives' tensors go
    devices = (str(collectives.group_device(prefer="cpu")), str(collectives.group_device(sub, prefer="cpu")))
    slowest = collectives.slowest_s(0.25 + rank, collectives.group_device(prefer="cpu")) if not error else None
    queue.put((rank, error, devices, slowest))
    time.sleep(run_module.CLOSE_GRACE_S)     # gloo frees the last collective on its own thread first: see Run.close
    dist.destroy_process_group()


def _probe(backend: str) -> list[tuple]:
    context = collectives.worker_context()     # the profiler's own (a fork server)
    queue = context.Queue()
    port = collectives.free_port()
    procs = [context.Process(target=_probe_group, args=(r, port, backend, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        while len(results) < len(procs):
            with contextlib.suppress(queue_module.Empty):
                results.append(queue.get(timeout=1))
            assert all(p.exitcode in (None, 0) for p in procs), "a probe worker failed (see its traceback)"
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return sorted(results)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_group_that_serves_only_cuda_gets_its_collective_tensors_on_cuda():
    # gloo declared for cuda only stands in for NCCL: it has no backend for a CPU tensor, the crash of
    # `tensoropt profile --device cuda` with 2 GPUs (its timings were all-reduced as CPU tensors)
    for rank, error, devices, _ in _probe("cuda:gloo"):
        assert "No backend type associated with device type cpu" in error, (rank, error)
        assert devices == ("cuda", "cuda")
    # a plain gloo group serves the CPU: tensors stay there, and the slowest rank's time is every rank's
    for _rank, error, devices, slowest in _probe("gloo"):
        assert error == "" and devices == ("cpu", "cpu")
        assert slowest == pytest.approx(1.25)


# --- defect 10: the timer, the copy sizes and the runtime overhead of measured GPU profiles ------------------

def test_timed_runs_back_to_back_calls_and_returns_one_calls_time():
    calls = []

    def spin(seconds: float = 50e-6) -> None:      # busy for a known time: no sleep, no scheduler granularity
        calls.append(1)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    seconds = timed(spin, "cpu", repeats=3, warmup=1)
    assert 50e-6 <= seconds < 5e-4                    # one call's time, not a sample's (~1 ms)
    # 1 warm-up, 1 call that sizes the samples, then 3 samples of ceil(1 ms / one call) <= 20 calls each (one
    # timed call alone, as before, would make 1 + 3)
    assert 2 + 3 <= len(calls) <= 2 + 3 * 20 and (len(calls) - 2) % 3 == 0
    # a call far below the timer's resolution is timed MAX_CALLS at a time
    counted = []
    timed(lambda: counted.append(1), "cpu", repeats=2, warmup=0)
    assert len(counted) == 1 + 2 * MAX_CALLS


def test_gpu_bandwidth_copies_leave_the_l2_and_cpu_copies_fit_a_small_machine():
    for quick in (True, False):
        gpu, cpu = Settings("cuda", 2, quick).plan, Settings("cpu", 2, quick).plan
        assert min(gpu["memory"]) * 4 >= GIB                  # float32 elements: a copy of 1 GiB or more
        assert max(cpu["memory"]) * 4 * 2 <= GIB              # source and destination together
        assert cpu["memory"] == (profiler_run.QUICK if quick else profiler_run.FULL)["memory"]


def test_a_measured_gpu_profile_keeps_its_datasheets_runtime_overhead():
    h100 = load_profile("h100-80gb").runtime_overhead_bytes
    assert h100 == 3 * GIB
    assert runtime_overhead_bytes("cuda", "NVIDIA H100 80GB HBM3")[0] == h100
    a100 = load_profile("a100-80gb").runtime_overhead_bytes
    assert runtime_overhead_bytes("cuda", "NVIDIA A100-SXM4-80GB")[0] == a100
    unknown, why = runtime_overhead_bytes("cuda", "NVIDIA GeForce RTX 4090")
    assert unknown == 3 * GIB and "no datasheet" in why              # the largest datasheet figure, not 512 MiB
    assert runtime_overhead_bytes("cpu", "Intel(R) Xeon(R)")[0] == DEFAULT_RUNTIME_OVERHEAD_BYTES == 512 * 2**20


# --- defect 9: threads of GPU workers, memory peaks after warm-up, the accuracy benchmark's figures ---------

def _devices(kind: str, count: int) -> Devices:
    return Devices(kind, count, 80 * GIB, load_profile("h100-80gb" if kind == "cuda" else "cpu-2core"))


def test_gpu_workers_get_their_share_of_the_host_threads(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert threads_per_worker(2) == 8 and threads_per_worker(32) == 1
    # torchrun would give each of several workers one thread; the launcher names the profile's count
    assert main_env(_devices("cuda", 2), tmp_path / "plan.json")["OMP_NUM_THREADS"] == "8"
    assert main_env(_devices("cpu", 2), tmp_path / "plan.json")["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")                       # the user's own choice stays
    assert main_env(_devices("cuda", 2), tmp_path / "plan.json")["OMP_NUM_THREADS"] == "3"
    # CPU workers compile (--compile) in their own process, GPU workers in inductor's pool of the host's cores
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert main_env(_devices("cpu", 2), tmp_path / "plan.json")["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in main_env(_devices("cuda", 2), tmp_path / "plan.json")


def test_the_runtime_resets_gpu_memory_peaks_after_the_first_step_only(monkeypatch):
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(str(device)))
    monkeypatch.setattr(run_module, "to_device", lambda batch, device: batch)    # no CUDA build here
    run = Run(stepper=lambda micro: 0.5, device=torch.device("cuda", 1), start_step=4, step=4)
    for _ in range(3):
        assert run.train_step(torch.zeros(4, 2)) == 0.5
    assert resets == ["cuda:1"] and run.step == 7
    cpu = Run(stepper=lambda micro: 0.5)
    cpu.train_step(torch.zeros(4, 2))
    assert resets == ["cuda:1"]                                      # nothing to reset on a CPU
    assert cpu.device_report()["max_memory_reserved_bytes"] is None


@pytest.fixture
def gpu_accuracy(benchmark_module):
    return benchmark_module("gpu_accuracy")


def test_gpu_accuracy_compares_tensors_with_tensors_and_reserved_with_the_total(gpu_accuracy):
    data = {"step_times_s": [9.0, 5.0, 1.0, 1.2, 1.1], "plan": "dp2", "max_memory_allocated_bytes": 20 * GIB,
            "max_memory_reserved_bytes": 22 * GIB,
            "predicted": {"iteration_time_s": 1.21, "peak_memory_bytes": 24 * GIB, "precision": "bf16"}}
    r = gpu_accuracy.row(gpu_accuracy.CASES[0], data, None, runtime_overhead_bytes=3 * GIB)
    assert r["predicted_tensor_bytes"] == 21 * GIB and r["memory_ratio"] == pytest.approx(21 / 20)
    assert r["predicted_memory_bytes"] == 24 * GIB and r["reserved_ratio"] == pytest.approx(24 / 22)
    assert r["time_error"] == pytest.approx(0.1)                      # median of the steps after the first two


def test_gpu_accuracy_scales_its_global_batch_with_the_devices(gpu_accuracy):
    largest = max(c.micro_batch for c in gpu_accuracy.CASES)
    for devices in (1, 2, 3, 8):
        batch = gpu_accuracy.default_global_batch(devices)
        gpu_accuracy.check_global_batch(batch, devices)               # no case gets zero micro-batches
        assert batch // (devices * largest) >= 1
    with pytest.raises(SystemExit, match="use a multiple of 24"):
        gpu_accuracy.check_global_batch(16, 3)                        # the old default on 3 GPUs: mb8x0
