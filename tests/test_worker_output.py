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


def test_a_line_teed_in_pieces_is_shown_whole():
    """torchrun's tee copies a worker's log file as far as it is written: a line printed under ``python -u`` (the
    text, then the newline: two writes) may come as two prefixed pieces, another rank's line between them (seen in
    the suite: ``checkpoint: ... step-00000002)tensoropt-rank0|``)."""
    output, shown = _read(["tensoropt-rank0|checkpoint: resuming from step 2tensoropt-rank1|step 3 loss 4.1\n",
                           "tensoropt-rank0|\n", "tensoropt-rank1|progress 10%\r", "tensoropt-rank1|progress 20%\n",
                           "I1130 torchrun's own line\n", "tensoropt-rank0|last words"])
    assert shown == "step 3 loss 4.1\ncheckpoint: resuming from step 2\nprogress 10%\rprogress 20%\n"
    assert output.torchrun == ["I1130 torchrun's own line\n"] and output.partial == {0: "last words"}
    output.finish(io.StringIO())
    assert output.last == {0: "last words", 1: "progress 10%\rprogress 20%"} and output.partial == {}
