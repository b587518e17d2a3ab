"""The launcher's processes: Ctrl-C while it captures and while workers train, a crash in one worker, and a
rendezvous no other node comes to. Each case waits for a sign of progress (a line, a file), never a fixed delay."""

import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import LAUNCH_CWD
from workers import ENV, GPT_SCRIPT, ctrl_c_reaches_it

pytestmark = [pytest.mark.slow]   # the tests that start workers share the "multiprocess" xdist group

# examples/train_gpt.py with rank 1 raising right after parallelize (the capture run, with no RANK, does not)
CRASH = """import os, runpy, sys
import tensoropt
if os.environ.get("RANK") == "1":
    applied = tensoropt.parallelize
    def parallelize(*args, **kwargs):
        applied(*args, **kwargs)
        raise ValueError("rank 1 broke on purpose")
    tensoropt.parallelize = parallelize
runpy.run_path({script!r}, run_name="__main__")
"""


def _launcher(tmp_path, script, *args, cwd=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tensoropt", "launch", str(script), "--device", "cpu", "--gpus",
                             "2", "--engine", "torch", "--run-dir", str(tmp_path / "run"), *map(str, args)],
                            cwd=cwd or tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_reaches_it)


def _interrupt(proc: subprocess.Popen) -> tuple[str, list, list[str]]:
    """SIGINT to the launcher alone (a terminal's Ctrl-C reaches its process group; the workers sit in torchrun's
    session); returns its stderr, the processes that were under it and their command lines."""
    under = psutil.Process(proc.pid).children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in under]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return err, under, commands


@pytest.mark.xdist_group("multiprocess")
# the launcher and torchrun start cold, so the processes under the launcher are the real torchrun and what it
# started; the workers start warm as test_elastic's do (the process torchrun started dies, and the script under the
# warm-start server with it: tests/test_warm_start.py). From the session's launch folder (every path absolute) the
# launcher finds the script's capture in the cache.
@pytest.mark.warm_start("scripts")
@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
def test_ctrl_c_during_a_training_launch_stops_every_worker(tmp_path, elastic):
    supervised = ["--elastic", "--checkpoint-dir", tmp_path / "ckpt"] if elastic else []
    proc = _launcher(tmp_path, GPT_SCRIPT, *supervised, "--", "--steps", 1000, "--pause-s", 0.05, cwd=LAUNCH_CWD)
    for line in proc.stdout:                         # rank 0 has trained a step: both workers are running
        if line.startswith("step 0 loss"):
            break
    err, under, commands = _interrupt(proc)
    assert proc.returncode == 130 and err.splitlines()[-1] == "interrupted", (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert sum("train_gpt.py" in command for command in commands) == 3, commands        # torchrun and 2 workers
    _, alive = psutil.wait_procs(under, timeout=30)
    assert not alive, alive


def test_ctrl_c_while_the_launcher_captures_the_model(tmp_path):
    marker = tmp_path / "capturing"
    script = tmp_path / "slow.py"
    script.write_text(f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(600)\n")
    proc = _launcher(tmp_path, script)
    while not marker.exists():                       # the capture run has started
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)                             # polling for the sign, not a fixed delay
    err, under, _ = _interrupt(proc)
    assert proc.returncode == 130 and err == "interrupted\n", (proc.returncode, err[-3000:])
    _, alive = psutil.wait_procs(under, timeout=30)
    assert under and not alive, alive
    assert not (tmp_path / "run").exists()


@pytest.mark.xdist_group("multiprocess")
@pytest.mark.warm_start("warm")          # reads the launcher's output and exit status, not its process tree
def test_a_crash_in_one_worker_shows_its_traceback_once(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH.format(script=GPT_SCRIPT))
    proc = _launcher(tmp_path, script, "--", "--steps", 3)
    _, err = proc.communicate(timeout=600)
    lines = err.splitlines()
    assert proc.returncode == 1, err[-3000:]
    assert err.count("Traceback") == 1 and "ChildFailedError" not in err and "Connection closed" not in err, err
    header = lines.index("--- rank 1 failed first (exit status 1); its traceback: ---")
    assert lines[header + 1] == "Traceback (most recent call last):"
    assert lines[-2] == "ValueError: rank 1 broke on purpose"
    assert lines[-1].startswith("error: rank 1 failed (exit status 1): ValueError: rank 1 broke on purpose "
                                "(traceback above); every rank's output: "), lines[-1]
    assert (tmp_path / "run" / "torchrun.log").read_text().count("ChildFailedError") >= 1     # kept, not shown


@pytest.mark.warm_start("warm")          # reads the launcher's output and exit status, not its process tree
def test_a_rendezvous_no_other_node_comes_to_stops_in_one_line(tmp_path):
    from test_launch import _two_free_ports
    port = _two_free_ports()
    proc = _launcher(tmp_path, GPT_SCRIPT, "--gpus", 1, "--nnodes", 2, "--master-addr", "127.0.0.1", "--master-port",
                     port, "--rendezvous-timeout", 2, "--", "--steps", 3)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and err.count("\n") == 1, err[-3000:]
    assert err.startswith("error: the nodes did not meet at the rendezvous (Timed out after ")
    assert "1/2 clients joined" in err and err.rstrip().endswith("or raise --rendezvous-timeout")
