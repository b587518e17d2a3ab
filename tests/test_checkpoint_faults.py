"""Checkpoints that survive faults (issue 38), with real workers: a launch with ``--checkpoint-dir`` and no
``--engine`` trains on 2 CPU workers; a truncated shard, a shard with flipped bytes, a missing ``.metadata`` and a
``latest.json`` naming nothing are each skipped in one line and the run resumes from the newest whole checkpoint,
ending with the uninterrupted run's parameters; a file system too small is one line before training, and a full one
mid-run (a file-size limit in the workers) one line naming the directory, the last checkpoint untouched.

One uninterrupted reference run writes the checkpoints of steps 2, 4 and 6; each fault case damages a copy of them
and resumes (``--steps 6``). A resumed run is the same plan on the same ranks over the same batches from the exact
saved state (DCP writes and reads float32 bytes unchanged), so its final parameters equal the reference's bitwise.
"""

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import LAUNCH_CWD
from workers import ENV, GPT_SCRIPT

from tensoropt.runtime.checkpoint.files import (
    LATEST,
    MANIFEST,
    candidates,
    digest,
    latest_step,
    manifest,
    problem,
    prune,
)

STEPS, EVERY = 6, 2
# the launcher's default precision (bf16-mixed), where DeepSpeed's plans are the fastest: the first run
DEFAULT_ENV = {k: v for k, v in ENV.items() if k != "TENSOROPT_PRECISION"}


def launch(tmp_path, checkpoints: Path, *extra, env=None, prefix=()) -> subprocess.CompletedProcess:
    """``tensoropt launch examples/train_gpt.py --gpus 2 --checkpoint-dir ... --checkpoint-every 2`` with the
    default objective, precision and engine choice, saving the final parameters to ``tmp_path/final.npy``."""
    argv = [*prefix, sys.executable, "-m", "tensoropt", "launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2,
            "--checkpoint-dir", checkpoints, "--checkpoint-every", EVERY, "--run-dir", tmp_path / "run", *extra, "--",
            "--steps", STEPS, "--save-params", tmp_path / "final.npy"]
    return subprocess.run(list(map(str, argv)), cwd=LAUNCH_CWD, env=env or DEFAULT_ENV, capture_output=True, text=True,
                          timeout=600)


def checkpoint_lines(result) -> list[str]:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("checkpoint:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its output, its checkpoints of steps 2, 4 and 6 (three kept), its final parameters."""
    tmp_path = tmp_path_factory.mktemp("reference")
    result = launch(tmp_path, tmp_path / "ck", "--keep-checkpoints", 3)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"result": result, "ck": tmp_path / "ck", "final": np.load(tmp_path / "final.npy")}


def copy_of(reference, tmp_path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(reference["ck"], ck)
    return ck


def largest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def shard_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name != MANIFEST)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_checkpoint_dir_without_engine_trains_on_the_torch_engine(reference):
    """Issue 38's first run: the launcher chooses among the plans that checkpoint instead of refusing its choice."""
    result, ck = reference["result"], reference["ck"]
    assert "(engine torch)" in result.stdout and "among the plans of the engines that checkpoint" in result.stdout
    assert checkpoint_lines(result) == []
    assert sorted(p.name for p in ck.iterdir()) == [LATEST, "step-00000002", "step-00000004", "step-00000006"]
    assert json.loads((ck / LATEST).read_text())["step"] == STEPS
    for step in (2, 4, 6):
        path = ck / f"step-{step:08d}"
        assert problem(path) is None
        files = json.loads((path / MANIFEST).read_text())["files"]
        assert set(files) == {p.name for p in path.iterdir()} - {MANIFEST} and ".metadata" in files
    # the size the launcher said before training, from the plan, against the files written
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("checkpoints:")]
    predicted = int(line.split(" MiB (")[1].split(" bytes")[0].replace(",", ""))
    assert predicted == pytest.approx(shard_bytes(ck / "step-00000006"), rel=0.05)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_truncated_shard_resumes_from_the_previous_checkpoint(reference, tmp_path):
    """Issue 38's second run: the latest checkpoint's largest shard cut short, as a partial copy leaves it."""
    ck = copy_of(reference, tmp_path)
    shard = largest_shard(ck / "step-00000006")
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    result = launch(tmp_path, ck)                                   # --keep-checkpoints: the default, 2
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint_lines(result) == [
        f"checkpoint: skipping step 6: {shard}: {size // 2:,} bytes, {size:,} when saved (truncated); resuming from "
        f"step 4 ({ck / 'step-00000004'})"]
    assert np.array_equal(np.load(tmp_path / "final.npy"), reference["final"])
    # the step trained again is saved whole over the damaged one; the previous one kept as the fallback, step 2
    # removed (two kept)
    assert sorted(p.name for p in ck.iterdir()) == [LATEST, "step-00000004", "step-00000006"]
    assert problem(ck / "step-00000006") is None and latest_step(ck) == STEPS


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_flipped_bytes_a_missing_metadata_and_latest_naming_nothing_are_each_skipped(reference, tmp_path):
    """latest.json names a checkpoint that is not there, step 6 has bytes flipped in a shard (its size unchanged),
    step 4 lost its .metadata: one line each, and the run resumes from step 2, the newest whole one."""
    ck = copy_of(reference, tmp_path)
    (ck / LATEST).write_text(json.dumps({"schema_version": 1, "step": 99, "path": "step-00000099"}))
    shard = largest_shard(ck / "step-00000006")
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    shard.write_bytes(bytes(data))
    (ck / "step-00000004" / ".metadata").unlink()
    result = launch(tmp_path, ck, "--keep-checkpoints", 3)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = f"resuming from step 2 ({ck / 'step-00000002'})"
    assert checkpoint_lines(result) == [
        f"checkpoint: {ck / LATEST} names step-00000099, which is not there; {resumed}",
        f"checkpoint: skipping step 6: {shard}: its SHA-256 differs from the one saved (damaged bytes); {resumed}",
        f"checkpoint: skipping step 4: {ck / 'step-00000004' / '.metadata'}: missing; {resumed}"]
    assert np.array_equal(np.load(tmp_path / "final.npy"), reference["final"])
    assert latest_step(ck) == STEPS and all(problem(ck / f"step-{s:08d}") is None for s in (2, 4, 6))


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_full_disk_mid_run_stops_in_one_line_and_keeps_the_last_checkpoint(reference, tmp_path):
    """The workers may write no file over 1 MB (``RLIMIT_FSIZE``, set in them by a sitecustomize): the save of
    step 4 fails (each rank's shard is ~1.5 MB) after resuming from step 2. One line names the directory and the
    bytes needed; the torn checkpoint is removed, latest.json and step 2 are left as they were."""
    ck = copy_of(reference, tmp_path)
    for step in (4, 6):
        shutil.rmtree(ck / f"step-{step:08d}")
    (ck / LATEST).write_text(json.dumps({"schema_version": 1, "step": 2, "path": "step-00000002"}))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, resource\n"
        "if os.environ.get('TENSOROPT_PLAN'):                    # torchrun and its workers, not the launcher\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))\n")
    env = DEFAULT_ENV | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), DEFAULT_ENV.get("PYTHONPATH")]))}
    result = launch(tmp_path, ck, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint of step 4 could not be written to {ck}: [Errno 27] File too large"), \
        last
    assert "file-size limit, ulimit -f, is 1,000,000 bytes" in last and "raise the file-size limit" in last
    needed = int(last.split("it needs ")[1].split(" bytes")[0].replace(",", ""))      # counted from the state
    assert needed == pytest.approx(shard_bytes(reference["ck"] / "step-00000002"), rel=0.05)
    assert last.endswith("the latest checkpoint, step-00000002, is untouched"), last
    assert [line for line in result.stderr.splitlines() if "checkpoint" in line] == [last]
    assert sorted(p.name for p in ck.iterdir()) == [LATEST, "step-00000002"]
    assert json.loads((ck / LATEST).read_text())["step"] == 2
    same = filecmp.dircmp(ck / "step-00000002", reference["ck"] / "step-00000002")
    assert not same.diff_files and not same.left_only and not same.right_only


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_a_checkpoint_dir_too_small_is_one_line_before_training(tmp_path):
    """Issue 38's third run: a 3 MB file system (a tmpfs, mounted in a user and mount namespace of the launch's own)
    takes no checkpoint of 3.1 MB, let alone the three that keeping two needs while the next is written."""
    if not _can_mount_tmpfs():
        pytest.skip("no tmpfs: this machine allows no unprivileged user and mount namespace (unshare -Urm)")
    ck = tmp_path / "ck"
    ck.mkdir()
    mount = ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=3m tmpfs "$0" && exec "$@"', str(ck)]
    result = launch(tmp_path, ck, prefix=mount)
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --checkpoint-dir {ck}: ") and "bytes free, the checkpoints need " in line, line
    assert line.endswith("free space there, point --checkpoint-dir at a larger disk or keep fewer "
                         "(--keep-checkpoints)"), line
    assert "step 0" not in result.stdout and not (tmp_path / "run" / "logs").exists()   # no worker started


def test_checkpoint_flags_that_cannot_work_are_one_line(tmp_path):
    for flags, expected in [(["--keep-checkpoints", "2"], "--keep-checkpoints keeps the checkpoints of "
                                                         "--checkpoint-dir"),
                            (["--checkpoint-dir", tmp_path / "ck", "--engine", "deepspeed"],
                             "--checkpoint-dir: the deepspeed engine does not checkpoint")]:
        result = subprocess.run([sys.executable, "-m", "tensoropt", "launch", GPT_SCRIPT, "--device", "cpu", "--gpus",
                                 "2", "--dry-run", "--run-dir", tmp_path / "run", *flags], cwd=LAUNCH_CWD, env=ENV,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 1 and result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
        assert not (tmp_path / "ck").exists()


def _fake_checkpoint(directory: Path, step: int) -> Path:
    path = directory / f"step-{step:08d}"
    path.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (path / name).write_bytes(bytes([step]) * 1000)
    (path / MANIFEST).write_text(json.dumps(manifest(step, {p.name: digest(p) for p in path.iterdir()})))
    return path


def test_candidates_problems_and_pruning_without_workers(tmp_path):
    """checkpoint.files alone: newest first from latest.json down, never above it; each damage named; pruning keeps
    the newest whole ones and removes torn partials, never the newest."""
    for step in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / LATEST).write_text(json.dumps({"schema_version": 1, "step": 6, "path": "step-00000006"}))
    found, notes = candidates(tmp_path)
    assert [c.step for c in found] == [6, 4, 2] and notes == []      # step 8 is above the commit: never loaded
    (tmp_path / LATEST).unlink()
    assert [c.step for c in candidates(tmp_path)[0]] == [8, 6, 4, 2]
    assert candidates(tmp_path)[1] == [f"{tmp_path / LATEST}: missing"]
    os.truncate(tmp_path / "step-00000008" / "__1_0.distcp", 10)
    assert "10 bytes, 1,000 when saved (truncated)" in problem(tmp_path / "step-00000008", deep=False)
    (tmp_path / "step-00000006" / "__0_0.distcp").write_bytes(b"x" * 1000)
    assert problem(tmp_path / "step-00000006", deep=False) is None
    assert "SHA-256 differs" in problem(tmp_path / "step-00000006")
    (tmp_path / "step-00000004" / MANIFEST).unlink()
    assert "manifest.json: missing" in problem(tmp_path / "step-00000004")
    assert latest_step(tmp_path) == 6                                # sizes only: the launcher's quick look
    (tmp_path / ".step-00000010.partial").mkdir()
    _fake_checkpoint(tmp_path, 10)
    prune(tmp_path, 10, keep=2, bad=frozenset({"step-00000006"}))
    # 8 is truncated, 6 damaged, 4 unfinished: 2 is the newest whole one below 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000010"]
