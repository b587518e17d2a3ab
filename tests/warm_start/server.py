"""Warm starts for the suite's Python processes: a server that has imported torch forks each one (test harness only).

Each training process the suite starts (a launched worker, a script run alone, the launcher's capture) spends ~5
CPU-s importing torch and ``torch._dynamo`` (which ``torch.optim`` imports at its first step) before it runs a line of
the code under test; ~500 of them are most of the suite's time (``benchmarks/suite_processes.py``). Here one server per
pytest process imports them once; a process started with ``sitecustomize.py`` (this folder) on its path hands its
command line, environment, working folder and standard streams to the server, which forks a child that runs the
script as ``python script.py`` would, and relays the child's exit status (or the signal it died of) back. The process
the test (or torchrun) started stays the one it waits for and signals:

- its SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 are passed to the child;
- when it dies (SIGKILL included) the child and everything under the child are killed (the child watches the
  connection: end of file);
- the child exits as the script would (``SystemExit``'s code, 1 after an uncaught exception shown by
  ``sys.excepthook``, killed by SIGINT after ``KeyboardInterrupt``), and the client exits alike.

What the child does not get from a fresh interpreter: a hash seed of its own (all children share the server's), and
imports made before its environment was set (torch reads none that the suite sets; ``OMP_NUM_THREADS`` is applied
with ``torch.set_num_threads``; transformers reads ``HF_HUB_OFFLINE``, which the server sets as the suite's scripts
do). A test that looks at the process tree switches the server off for itself, or on for
scripts only (``COLD_MODULES`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.run", "launcher.torchrun", "tensoropt.cli", "launcher.cli",
           "numpy", "tensoropt.runtime.entry", "tensoropt.runtime.engines.torch_engine", "tensoropt.runtime.run")
# Hugging Face: ~3.4 CPU-s of imports (transformers and a model family's modeling module; building a small model from
# its config then takes ~0.03 s) in every process that runs a Hugging Face script (examples/train_hf.py's workers,
# the script alone, the launcher's capture of it); the families the suite's scripts build
HF_FAMILIES = ("gpt2", "phi3", "falcon", "llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
HF_PRELOAD = ("transformers", "transformers.integrations.moe",
              *(f"transformers.models.{family}.modeling_{family}" for family in HF_FAMILIES))
# DeepSpeed: ~1.7 CPU-s in each DeepSpeed worker (its engine's optimizer check imports its Muon optimizer, which
# imports torch._inductor); its accelerator is detected here once (the suite's are CPUs)
DEEPSPEED_PRELOAD = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")
HEADER = struct.Struct("!I")


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's request (JSON) and the three file descriptors it passed (stdin, stdout, stderr)."""
    fds = array.array("i")
    data = b""
    while len(data) < HEADER.size:
        chunk, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not chunk:
            raise ConnectionError("client closed before its request")
        data += chunk
    (size,) = HEADER.unpack(data[:HEADER.size])
    data = data[HEADER.size:]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("client closed during its request")
        data += chunk
    return json.loads(data), list(fds)


def preload(names: tuple[str, ...]) -> None:
    """Import ``names`` with what they print to standard output sent to standard error: the server's standard output
    is its protocol with pytest ("ready", "ok"), and DeepSpeed logs its accelerator to it at import. Only the file
    descriptor moves for the while: ``sys.stdout`` (which DeepSpeed's log handler keeps) still writes to fd 1, the
    client's standard output in each child."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        for name in names:
            __import__(name)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def serve(path: str) -> None:
    # the suite never reaches the Hugging Face Hub (CI sets this too; the scripts set it before importing
    # transformers, which reads it at import, as the children's imports are made here)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    preload((*PRELOAD, *HF_PRELOAD, *DEEPSPEED_PRELOAD))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, tuple[int, socket.socket, dict]] = {}    # pidfd -> (pid, connection, request)
    from sitecustomize import namespaces  # this folder's (first on the path of ``python server.py``)
    own_namespaces = namespaces()
    mode = "warm"
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin, listener, *children], [], [])
        for ready in readable:
            if ready is sys.stdin:                              # the controlling pytest process: on / off / exit
                line = sys.stdin.readline().strip()
                if line in ("", "exit"):
                    os._exit(0)
                mode = line                                     # warm, cold, or scripts (modules cold)
                print("ok", flush=True)
            elif ready is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = recv_request(conn)
                except (OSError, ConnectionError, ValueError):
                    conn.close()
                    continue
                if mode == "cold" or (mode == "scripts" and request.get("module")) \
                        or request.get("namespaces") != own_namespaces:
                    conn.sendall(b"C")
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for _, other, _ in children.values():
                        other.close()
                    _child(conn, request, fds)          # never returns
                for fd in fds:
                    os.close(fd)
                children[os.pidfd_open(pid)] = (pid, conn, request)
            else:
                pid, conn, request = children.pop(ready)
                _, status, usage = os.wait4(pid, 0)
                _log_usage(request, usage)
                os.close(ready)
                with contextlib.suppress(OSError):
                    conn.sendall(b"X" + struct.pack("!i", status))
                conn.close()


def _log_usage(request: dict, usage) -> None:
    """With ``TENSOROPT_TEST_WARM_LOG`` set (a file), append one JSON line per finished child: what it ran and the
    CPU seconds it and the processes it waited for took (``wait4``; a forked child's count starts at zero), which
    tells where a suite's CPU time goes (processes by kind: workers, torchrun, captures...)."""
    if path := os.environ.get("TENSOROPT_TEST_WARM_LOG"):
        record = {"module": request.get("module"), "argv": request.get("argv", [])[:16],
                  "cpu_s": usage.ru_utime + usage.ru_stime}
        with open(path, "a") as log:
            log.write(json.dumps(record) + "\n")


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Become the process the client asked for, run it, and exit as it would."""
    import threading
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reopen_streams(request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=_watch, args=(conn,), daemon=True).start()
        _fresh_state()
        code = _run(request)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:                                   # noqa: BLE001 - the harness itself failed
        import traceback
        traceback.print_exc()
    _finish(code)


def _run(request: dict) -> int:
    import runpy
    argv = request["argv"]
    try:
        if request["module"]:
            sys.argv = [request["module"], *argv]
            sys.path[0] = os.getcwd()                       # as ``python -m``: the working folder first
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:                               # as the interpreter: shown, then killed by SIGINT
        sys.excepthook(*sys.exc_info())
        _finish(None, interrupted=True)
    except BaseException:                                   # noqa: BLE001 - as the interpreter: shown, status 1
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int | None, interrupted: bool = False) -> None:
    """Exit as the interpreter does: other threads joined, exit handlers run, streams flushed; after an uncaught
    KeyboardInterrupt, killed by SIGINT."""
    import atexit
    import threading
    with contextlib.suppress(Exception):
        threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code if code is not None else 1)


def _reopen_streams(unbuffered: bool) -> None:
    import io
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        errors = "backslashreplace" if fd == 2 else None
        if unbuffered and fd:
            stream = io.TextIOWrapper(raw, write_through=True, errors=errors)
        elif fd == 0:
            stream = io.TextIOWrapper(io.BufferedReader(raw))
        else:                       # as Python: stderr line-buffered, stdout where it is a terminal
            stream = io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=fd == 2 or os.isatty(fd), errors=errors)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_state() -> None:
    """What a fresh interpreter would have drawn or read at start: random seeds, torch's thread count."""
    import random

    import numpy as np
    import torch
    random.seed()
    np.random.seed()
    if threads := os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))


def _watch(conn: socket.socket) -> None:
    """Signals the client passes on; its end (it died) kills this process and everything under it."""
    pending = b""
    while True:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if not data:
            _kill_tree()
        pending += data
        while len(pending) >= 2:
            if pending[:1] == b"S":
                os.kill(os.getpid(), pending[1])
            pending = pending[2:]


def _kill_tree() -> None:
    import psutil
    try:
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
