"""The GPUs a launch counts and their free memory, found without a CUDA context in the launcher (issue 17,
defects 5 and 7). A fake ``nvidia-smi`` on PATH stands in for the driver: it prints a listing and a memory
table, and logs each call, as the real one would on an 8-GPU node."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from workers import ENV, GPT_SCRIPT, tensoropt_cli

from launcher.devices import detect
from launcher.elastic import resources
from launcher.gpus import cuda_visible, gpu_count, parse_listing, usable
from tensoropt.cost.profile import load_profile
from tensoropt.errors import TensorOptError

GIB, MIB = 2**30, 2**20
H100 = "NVIDIA H100 80GB HBM3"


def uuid(i: int) -> str:
    return f"GPU-{i}a1b2c3d-0000-1111-2222-33334444555{i}"


def mig_uuid(gpu: int, i: int) -> str:
    return f"MIG-{gpu}{i}e5f6a7b-8888-9999-aaaa-bbbbccccdddd"


EIGHT = "".join(f"GPU {i}: {H100} (UUID: {uuid(i)})\n" for i in range(8))
# GPU 0 split into three MIG instances, GPU 1 whole
MIG = (f"GPU 0: {H100} (UUID: {uuid(0)})\n"
       + "".join(f"  MIG 2g.20gb     Device  {i}: (UUID: {mig_uuid(0, i)})\n" for i in range(3))
       + f"GPU 1: {H100} (UUID: {uuid(1)})\n")
# free MiB per GPU: GPU 1 has the least of GPUs 0-1, GPUs 2-7 even less (visible only without CUDA_VISIBLE_DEVICES)
FREE_MIB = [80000, 60000, 1000, 1000, 1000, 1000, 1000, 1000]
TOTAL_MIB = 81559


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """Put a fake nvidia-smi first on PATH; returns a function that sets its listing and the log of its calls."""
    folder = tmp_path / "fake-smi"
    folder.mkdir()
    (folder / "memory.csv").write_text("".join(f"{uuid(i)}, {free}, {TOTAL_MIB}\n" for i, free in enumerate(FREE_MIB)))
    script = folder / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
echo "$*" >> {folder}/calls.log
case "$1" in
  -L) cat {folder}/listing.txt ;;
  --query-gpu=uuid,memory.free,memory.total) cat {folder}/memory.csv ;;
  topo|nvlink) if [ -f {folder}/$1.txt ]; then cat {folder}/$1.txt; else echo "not supported" >&2; exit 3; fi ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
esac
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{ENV['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def listing(text: str) -> Path:
        (folder / "listing.txt").write_text(text)
        return folder / "calls.log"
    return listing


def test_cuda_visible_devices_selects_as_cuda_does():
    listed = parse_listing(EIGHT)
    assert [g.index for g in cuda_visible(listed, None)] == list(range(8))
    assert [g.index for g in cuda_visible(listed, "0,1")] == [0, 1]
    assert [g.index for g in cuda_visible(listed, f"{uuid(3)[:6]},1")] == [3, 1]     # a unique UUID prefix
    assert [g.index for g in cuda_visible(listed, "2, 5")] == [2, 5]
    assert [g.index for g in cuda_visible(listed, "0,2,-1,1")] == [0, 2]             # a negative index stops it
    assert [g.index for g in cuda_visible(listed, "1,9,2")] == [1]                  # so does one that names no GPU
    assert [g.index for g in cuda_visible(listed, "GPU-,0")] == []                   # an ambiguous prefix
    assert cuda_visible(listed, "1,1") == [] and cuda_visible(listed, "") == []


def test_a_mig_gpu_is_its_instances_and_a_worker_process_sees_one_of_them():
    listed = parse_listing(MIG)
    assert [item.gpu.index for item in listed] == [0, 1] and len(listed[0].instances) == 3
    visible = cuda_visible(listed, None)
    assert [(g.index, g.mig) for g in visible] == [(0, "2g.20gb")] * 3 + [(1, "")]
    assert [g.uuid for g in usable(visible)] == [uuid(1), mig_uuid(0, 0)]
    assert [g.uuid for g in cuda_visible(listed, f"{mig_uuid(0, 2)},{mig_uuid(0, 1)}")] == [mig_uuid(0, 2),
                                                                                           mig_uuid(0, 1)]
    assert len(usable(cuda_visible(listed, f"{mig_uuid(0, 2)},{mig_uuid(0, 1)}"))) == 1
    assert [g.uuid for g in cuda_visible(listed, "1")] == [uuid(1)]
    assert [g.uuid for g in cuda_visible(listed, f"MIG-{uuid(0)}/1/0")] == [mig_uuid(0, 0)]   # the older form


def test_gpu_count_honours_cuda_visible_devices_gpus_and_mig(fake_smi, monkeypatch):
    fake_smi(EIGHT)
    assert gpu_count() == 8 and gpu_count(2) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu_count() == 2 and gpu_count(8) == 2 and gpu_count(1) == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    fake_smi(MIG)
    assert gpu_count() == 2                         # GPU 1 and one of GPU 0's three instances
    monkeypatch.setenv("PATH", str(Path(fake_smi("").parent / "nowhere")))
    assert gpu_count() is None                      # no driver: nothing to say


def _cuda(count: int):
    return detect("cuda", count, None, None, dry_run=True)


def test_elastic_runs_count_only_the_gpus_they_may_use(fake_smi, monkeypatch):
    """On an 8-GPU node, an elastic run with --gpus 2 (or CUDA_VISIBLE_DEVICES=0,1) watches 2 GPUs, not 8."""
    fake_smi(EIGHT)
    devices = detect(None, 2, None, None)
    assert resources(devices, None, max_gpus=2).count == 2
    assert resources(devices, None).count == 8                         # without --gpus every visible GPU counts
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert resources(devices, None).count == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")                    # one taken away while the job runs
    assert resources(devices, None, max_gpus=2).count == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    fake_smi(MIG)
    assert resources(devices, None).count == 2


def test_the_launcher_reads_gpus_and_free_memory_through_nvidia_smi_without_cuda(fake_smi, monkeypatch):
    calls = fake_smi(EIGHT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    devices = detect(None, None, None, None)
    assert (devices.kind, devices.count, devices.memory_bytes) == ("cuda", 2, FREE_MIB[1] * MIB)
    assert devices.profile_name == "h100-80gb" and devices.profile.memory_bytes == FREE_MIB[1] * MIB
    assert devices.note == f"GPU 1 has {FREE_MIB[1] * MIB / GIB:.1f} of {TOTAL_MIB * MIB / GIB:.1f} GiB free " \
                           "(another process holds the rest)"
    assert calls.read_text().splitlines() == ["-L", "--query-gpu=uuid,memory.free,memory.total --format=csv,noheader,"
                                                    "nounits", "topo -m", "nvlink -s"]
    assert not torch.cuda.is_initialized()
    with pytest.raises(TensorOptError, match=r"^--gpus 4 asks for more GPUs than the 2 visible here "
                                             r"\(CUDA_VISIBLE_DEVICES='0,1'\): use --gpus 2 or fewer"):
        detect("cuda", 4, None, None)
    with pytest.raises(TensorOptError, match=r"^--mem-per-gpu 70.0 GiB is more than the 58.6 GiB free on GPU 1"):
        detect(None, 2, 70 * GIB, None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(TensorOptError, match=r"^nvidia-smi lists GPUs but CUDA_VISIBLE_DEVICES='' leaves none"):
        detect(None, None, None, None)
    assert _cuda(8).note.startswith("no GPU here")                     # a dry run may still plan for GPUs


def test_mig_memory_is_read_in_a_short_lived_process(fake_smi, monkeypatch):
    """nvidia-smi gives memory per physical GPU, so a MIG instance's is read by a child process (whose CUDA
    context ends with it); on this CPU machine the child says it sees no GPU, in one line."""
    fake_smi(MIG)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{mig_uuid(0, 1)},{mig_uuid(0, 2)}")
    with pytest.raises(TensorOptError, match=r"^--gpus 2 asks for more GPUs than the 1 visible here .*; 2 MIG "
                                             r"instances are visible, but a CUDA process sees only one\)"):
        detect(None, 2, None, None)
    if not torch.cuda.is_available():
        with pytest.raises(TensorOptError, match=r"^cannot read the GPUs' free memory: error: this process sees 0 "
                                                 r"GPU\(s\), 1 asked for$"):
            detect(None, None, None, None)
    assert not torch.cuda.is_initialized()


def test_the_memory_query_module_answers_in_json_or_one_line():
    result = subprocess.run([sys.executable, "-m", "launcher.gpus", "memory", "0"], capture_output=True, text=True,
                            env=ENV, timeout=120)
    assert (result.returncode, json.loads(result.stdout)) == (0, [])
    result = subprocess.run([sys.executable, "-m", "launcher.gpus", "memory", "64"], capture_output=True, text=True,
                            env=ENV, timeout=120)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "64 asked for" in result.stderr


@pytest.mark.slow
def test_launch_plans_for_the_visible_gpus_of_an_eight_gpu_node(fake_smi, tmp_path, monkeypatch):
    fake_smi(EIGHT)
    env = {**ENV, "PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "0,1"}
    result = tensoropt_cli("launch", GPT_SCRIPT, "--run-dir", tmp_path / "run", "--dry-run", "--", "--steps", 3,
                           cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"devices: 2 x cuda ({FREE_MIB[1] * MIB / GIB:.1f} GiB each), profile h100-80gb" in result.stdout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["devices"], plan["device"]) == (2, "cuda")
    assert load_profile("h100-80gb").memory_bytes > FREE_MIB[1] * MIB
