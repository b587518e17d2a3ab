"""How the launcher reads its workers' teed stderr and torchrun's report (``launcher.workers``), on lines in the
formats torch 2.13's torchrun writes; tests/test_launch_proc.py runs the real processes."""

import io

from launcher.workers import Outcome, WorkerOutput, report

ROOT_CAUSE = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_18:45:03
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 28689)
  error_file: <N/A>
"""


def _read(lines: list[str]) -> tuple[WorkerOutput, str]:
    output, shown = WorkerOutput(), io.StringIO()
    for line in lines:
        output.take(line, shown)
    return output, shown.getvalue()


def test_a_worker_killed_without_a_traceback_is_named_not_the_peer_that_lost_it():
    output, shown = _read(["tensoropt-rank0|step 0 started\n", "tensoropt-rank1|[rank1]: Traceback (most recent "
                           "call last):\n", "tensoropt-rank1|[rank1]: RuntimeError: Connection closed by peer\n",
                           "E1125 18:45:03.957000 28643 torch/distributed/elastic/multiprocessing/api.py:1002] "
                           "failed\n", *ROOT_CAUSE.format(rank=0, code=-9).splitlines(keepends=True)])
    assert shown == "step 0 started\n"                          # the worker's line as written; tracebacks held
    header = io.StringIO()
    assert report(Outcome(1, False, output), header) == "rank 0 failed (killed by SIGKILL): step 0 started"
    assert header.getvalue() == ""                              # rank 1's traceback is a consequence: not shown


def test_the_first_failing_ranks_traceback_is_shown_once_without_its_prefix():
    output, shown = _read(["tensoropt-rank1|[rank1]: Traceback (most recent call last):\n",
                           "tensoropt-rank1|[rank1]:   File \"train.py\", line 3, in <module>\n",
                           "tensoropt-rank1|[rank1]: ValueError: bad batch\n",
                           *ROOT_CAUSE.format(rank=1, code=1).splitlines(keepends=True)])
    header = io.StringIO()
    assert shown == "" and report(Outcome(1, False, output), header) == \
        "rank 1 failed (exit status 1): ValueError: bad batch (traceback above)"
    assert header.getvalue() == ("--- rank 1 failed first (exit status 1); its traceback: ---\n"
                                 "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
                                 "ValueError: bad batch\n")
