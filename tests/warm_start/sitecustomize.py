"""Hand this process to the warm-start server (``server.py``, this folder) when the suite runs one and this is a
process it can start: ``python [-u] SCRIPT.py ...`` or ``python -m MODULE ...`` for the modules below (the launcher
and the other CLI commands, torchrun, the launcher's capture). Anything else, or a server that says "cold" (turned
off for the test, or this process in namespaces of its own), starts as usual."""

import contextlib
import os
import sys

SOCKET_ENV = "TENSOROPT_TEST_WARM_SOCKET"
MODULES = ("tensoropt.runtime.capture_run", "torch.distributed.run", "launcher.torchrun", "tensoropt")


def _request():
    flags, args = [], list(getattr(sys, "orig_argv", [])[1:])
    while args and args[0] in ("-u", "-B", "-E", "-s"):
        flags.append(args.pop(0))
    if not args:
        return None
    if args[0] == "-m" and len(args) > 1 and args[1] in MODULES:
        return {"module": args[1], "argv": args[2:], "unbuffered": "-u" in flags}
    if args[0].endswith(".py") and not args[0].startswith("-") and os.path.isfile(args[0]):
        return {"module": "", "argv": args, "unbuffered": "-u" in flags}
    return None


def namespaces():
    """This process's Linux namespaces: one started in others (``unshare``: a file system mounted for it alone) is
    not the server's to fork."""
    found = {}
    for kind in ("mnt", "user", "pid", "net", "ipc", "uts"):
        with contextlib.suppress(OSError):
            found[kind] = os.readlink(f"/proc/self/ns/{kind}")
    return found


def _delegate(path, request):
    import json
    import signal
    import socket
    import struct
    request.update(env=dict(os.environ), cwd=os.getcwd(), namespaces=namespaces())
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        payload = json.dumps(request).encode()
        socket.send_fds(conn, [struct.pack("!I", len(payload)) + payload], [0, 1, 2])
    except OSError:
        conn.close()
        return                                   # no server: start as usual

    def forward(signum, _frame):
        with contextlib.suppress(OSError):
            conn.sendall(b"S" + bytes([signum]))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    data = b""
    while True:
        try:
            chunk = conn.recv(16)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
        if data[:1] == b"C":                     # cold: start as usual
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            conn.close()
            return
        if len(data) >= 5:
            break
    status = struct.unpack("!i", data[1:5])[0] if len(data) >= 5 and data[:1] == b"X" else 1 << 8
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if (_path := os.environ.get(SOCKET_ENV)) and (_req := _request()) is not None:
    _delegate(_path, _req)
