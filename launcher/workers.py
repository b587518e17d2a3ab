"""Run one node's torchrun and say what its workers did in the launcher's own words.

Left alone, a crash in the workers reaches the user three times: the failing rank's traceback, the
tracebacks of the ranks that lost their peer ("Connection closed by peer"), and torchrun's
``ChildFailedError`` dump with its own traceback. Here torchrun writes each worker's stderr to a log file
and echoes it with a rank prefix (``--redirects 2 --tee 2``, ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), so
the launcher can tell the workers' lines from torchrun's own:

- a worker's line is shown as the worker wrote it, except that from a ``Traceback`` on, a rank's lines are
  held back: at the end the first failing rank's traceback is shown once, under a header (a run that
  succeeds shows what it held);
- torchrun's own lines go to ``RUN_DIR/torchrun.log`` only; its root-cause report says which rank failed first.

Workers' stdout is not touched (it stays the terminal's). Ctrl-C or SIGTERM to the launcher kills torchrun
and every worker under it at once (they may sit in sessions of their own), so nothing prints a
``KeyboardInterrupt`` traceback and nothing survives the launcher.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

LINE_PREFIX = "tensoropt-rank${rank}|"          # torchrun substitutes the global rank
_PREFIXED = re.compile(r"tensoropt-rank(\d+)\|")
_OWN_PREFIX = re.compile(r"^\[rank\d+\]: ?")     # torch's excepthook prefixes a worker's traceback lines itself
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
# each failure of torchrun's report: its time (to the second), rank and exit code
_FAILURE = re.compile(r"time\s*:\s*(\S+)\s*\n\s*host\s*:[^\n]*\n\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
# a worker's error that says a peer went first (gloo's, NCCL's, a socket's): not the root cause beside one that is not
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer|remote process exited|Broken pipe", re.I)
# torchrun's own exception when the nodes never met (the static rendezvous' TCPStore: the master timed out
# waiting for the other nodes, or a node could not reach the master)
_RENDEZVOUS = re.compile(r"(?:DistStoreError|DistNetworkError|RendezvousTimeoutError|RendezvousError)\b:?[ \t]*(.*)")
STOP_WAIT_S = 30


@dataclass
class WorkerOutput:
    """What the workers wrote to stderr, by global rank, and torchrun's own lines."""

    held: dict[int, list[str]] = field(default_factory=dict)      # from a traceback on, per rank
    order: list[int] = field(default_factory=list)                # ranks in the order their tracebacks began
    last: dict[int, str] = field(default_factory=dict)            # each rank's last non-empty line
    torchrun: list[str] = field(default_factory=list)
    partial: dict[int, str] = field(default_factory=dict)         # a rank's line not ended yet

    def take(self, line: str, out) -> None:
        """One line of torchrun's stderr: its own, or workers' pieces. torchrun's tee copies what a worker's log
        file holds when it looks, so a line the worker wrote in two writes (``print`` under ``python -u``: the text,
        then the newline) arrives as two pieces, each with the rank's prefix, maybe with another rank's between:
        ``tensoropt-rank0|text`` ``tensoropt-rank1|...`` ``tensoropt-rank0|\n``. A rank's pieces are joined into
        its line before it is read."""
        own, *pieces = _PREFIXED.split(line)
        if own or not pieces:
            self.torchrun.append(own if pieces else line)
        for rank, text in zip(pieces[::2], pieces[1::2]):
            text = self.partial.pop(int(rank), "") + text
            if text.endswith("\n"):
                self._worker_line(int(rank), text, out)
            else:
                self.partial[int(rank)] = text

    def finish(self, out) -> None:
        """The ranks' last lines that ended without a newline."""
        for rank, text in list(self.partial.items()):
            del self.partial[rank]
            self._worker_line(rank, text, out)

    def _worker_line(self, rank: int, text: str, out) -> None:
        plain = _OWN_PREFIX.sub("", text, count=1)
        if plain.strip():
            self.last[rank] = plain.rstrip("\n")
        if rank in self.held or plain.startswith("Traceback (most recent call last):"):
            if rank not in self.held:
                self.held[rank] = []
                self.order.append(rank)
            self.held[rank].append(plain)
        else:
            out.write(text)
            out.flush()

    def first_failure(self) -> tuple[int | None, int | None]:
        """(rank, exit code) of the first failure torchrun observed, else the first rank that printed a traceback.
        torchrun times failures to the second and, among those it saw in one poll, names the lowest rank
        (``ChildFailedError.get_first_failure``: ``min`` over ranks by an integer timestamp): a rank that died of a
        peer's death (gloo's "Connection closed by peer") ties with that peer whenever both exit between two of its
        polls. Among the ranks tied with torchrun's choice, the first whose traceback does not blame a peer is it."""
        text = "".join(self.torchrun)
        if not (match := _ROOT_CAUSE.search(text)):
            return (self.order[0] if self.order else None), None
        rank, code = int(match.group(1)), int(match.group(2))
        failures = {int(r): (when, int(c)) for when, r, c in _FAILURE.findall(text)}     # the root cause's among them
        tied = {r for r, (when, _) in failures.items() if when == failures.get(rank, (None,))[0]}
        if len(tied) > 1 and _PEER_GONE.search(self.last.get(rank, "")):
            cause = next((r for r in self.order if r in tied and not _PEER_GONE.search(self.last.get(r, ""))), rank)
            return cause, failures[cause][1]
        return rank, code

    def rendezvous_failure(self) -> str | None:
        """torchrun's reason, when it stopped because the nodes never met (no worker started)."""
        found = [m for line in self.torchrun if (m := _RENDEZVOUS.search(line))]
        if self.last or not found:
            return None
        return found[-1].group(1).strip() or found[-1].group(0).strip()


@dataclass
class Outcome:
    status: int
    interrupted: bool
    output: WorkerOutput


def kill_tree(pid: int) -> list:
    """SIGKILL ``pid`` and every process under it (workers may sit in sessions of their own); returns them, to
    wait for. SIGTERM would only make torchrun print a stack trace, and a survivor would wait in a collective
    forever. Safe in a signal handler: it waits for nothing."""
    import psutil
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return tree


def stop_tree(proc: subprocess.Popen) -> None:
    """Kill torchrun (``proc``) and every worker under it, and wait until they are gone."""
    import psutil
    tree = kill_tree(proc.pid)
    proc.wait()
    psutil.wait_procs(tree, timeout=STOP_WAIT_S)


def run(argv: list[str], env: dict, log_path: Path, out=None) -> Outcome:
    """Run torchrun (``argv``, built with a ``log_dir``: ``argv.torchrun_argv``), relay the workers' stderr,
    keep torchrun's own in ``log_path``; on SIGINT/SIGTERM stop everything. Returns torchrun's status and what
    was held back."""
    import psutil
    out = out or sys.stderr
    output, stopping, killed = WorkerOutput(), threading.Event(), []

    def on_signal(_signum, _frame):         # runs inside proc.wait(): kill, never wait here
        stopping.set()
        if proc is not None:
            killed.extend(kill_tree(proc.pid))
    proc = None
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = subprocess.Popen(argv, env=env | {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LINE_PREFIX},
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        if stopping.is_set():                   # a signal came before the process existed
            killed.extend(kill_tree(proc.pid))
        reader = threading.Thread(target=_relay, args=(proc.stderr, output, out), daemon=True)
        reader.start()
        status = proc.wait()
        psutil.wait_procs(killed, timeout=STOP_WAIT_S)
        reader.join(STOP_WAIT_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("".join(output.torchrun))
    return Outcome(status, stopping.is_set(), output)


def _relay(stream, output: WorkerOutput, out) -> None:
    for line in stream:
        output.take(line, out)
    output.finish(out)


FAILURE_NOTES = "failure-rank*.json"      # what a worker notes before it stops (tensoropt.runtime.run)


def clear_failure_notes(run_dir: Path) -> None:
    """Remove the notes of an earlier start in ``run_dir``, so that ``failure_note`` reads this start's only."""
    for stale in run_dir.glob(FAILURE_NOTES):
        stale.unlink()


def failure_note(run_dir: Path) -> dict | None:
    """What a worker noted before it stopped (``tensoropt.runtime.run``: out of memory, a checkpoint), the lowest
    rank's, if any."""
    for path in sorted(run_dir.glob(FAILURE_NOTES), key=lambda p: (len(p.name), p.name)):
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
    return None


def report(outcome: Outcome, out=None) -> str:
    """Show the first failing rank's own error (its traceback once, under a header) and return the one-line
    summary the launcher stops with."""
    out = out or sys.stderr
    output = outcome.output
    if reason := output.rendezvous_failure():
        return (f"the nodes did not meet at the rendezvous ({reason[:200]}): start every node with the same "
                "--nnodes, --master-addr and --master-port, or raise --rendezvous-timeout")
    rank, code = output.first_failure()
    if rank is None:
        return f"workers exited with status {outcome.status}"
    how = _exit_words(code)
    if rank in output.held:
        lines = output.held[rank]
        out.write(f"--- rank {rank} failed first{how}; its traceback: ---\n")
        out.write("".join(lines))
        out.flush()
        return f"rank {rank} failed{how}: {_last_line(lines)} (traceback above)"
    last = output.last.get(rank)
    return f"rank {rank} failed{how}" + (f": {last}" if last else " without a message")


def release_held(output: WorkerOutput, out=None) -> None:
    """A run that succeeded shows the tracebacks its workers printed and survived, at the end."""
    out = out or sys.stderr
    for rank in output.order:
        out.write("".join(output.held[rank]))
    out.flush()


def _exit_words(code: int | None) -> str:
    if code is None or code == 0:
        return ""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f" (killed by {signal.Signals(-code).name})"
    return f" (exit status {code})"


def _last_line(lines: list[str]) -> str:
    text = [line.strip() for line in lines if line.strip()]
    return text[-1][:300] if text else "(no message)"


__all__ = ["Outcome", "WorkerOutput", "failure_note", "kill_tree", "release_held", "report", "run", "stop_tree"]
