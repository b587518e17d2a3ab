"""The suite's warm starts (tests/warm_start): a process the tests start is forked by the server and behaves as the
one started cold would, for what the tests and torchrun see of it: its output, its exit status, the signals it gets,
and its end when the process that was started dies."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import WARM

pytestmark = pytest.mark.skipif(not WARM, reason="warm starts are off (TENSOROPT_TEST_WARM=0)")

SCRIPT = """
import os, sys, time
from pathlib import Path
print("warm" if "torch" in sys.modules else "cold", os.environ.get("PROBE"), sys.argv[1:], Path.cwd().name, flush=True)
Path(sys.argv[1]).write_text(str(os.getpid()))
if sys.argv[2] == "exit":
    sys.exit(int(sys.argv[3]))
if sys.argv[2] == "raise":
    raise ValueError("from the script")
while not Path(sys.argv[1] + ".stop").exists():
    time.sleep(0.01)
"""


def _start(tmp_path, *args):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    return subprocess.Popen([sys.executable, "-u", str(script), str(tmp_path / "pid"), *args], cwd=tmp_path,
                            env={**os.environ, "PROBE": "set"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _child_pid(tmp_path, proc) -> int:
    """The pid the script itself runs as (the server's child), once it wrote it."""
    deadline = time.monotonic() + 120
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "the script did not start"
        time.sleep(0.01)
    return int((tmp_path / "pid").read_text())


def _gone(pid: int) -> bool:
    """Whether the script's process ended (waited for up to a minute: the server reaps it)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=60)
    return not psutil.pid_exists(pid)


def test_a_warm_started_script_gets_its_arguments_environment_folder_and_exit_status(tmp_path):
    proc = _start(tmp_path, "exit", "7")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err
    assert out.split()[0] == "warm" and out.split()[1] == "set" and tmp_path.name in out, out
    assert int((tmp_path / "pid").read_text()) != proc.pid             # it ran in the server's child


def test_an_uncaught_exception_shows_its_traceback_and_exits_1(tmp_path):
    proc = _start(tmp_path, "raise")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in err and "ValueError: from the script" in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_started_process_reaches_the_script(tmp_path, sig):
    proc = _start(tmp_path, "wait")
    child = _child_pid(tmp_path, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -sig, err          # SIGINT: KeyboardInterrupt, then killed by SIGINT, as Python does
    assert _gone(child)


def test_killing_the_started_process_kills_the_script(tmp_path):
    proc = _start(tmp_path, "wait")
    child = _child_pid(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert _gone(child) and not (tmp_path / "pid.stop").exists()
