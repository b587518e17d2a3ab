"""How the launcher reads its workers' teed stderr and torchrun's report (``launcher.workers``), on lines in the
formats torch 2.13's torchrun writes; tests/test_launch_proc.py runs the real processes."""

import io

from launcher.workers import Outcome, WorkerOutput, report

FAILURE = """  time      : 2026-11-25_18:45:03
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 28689)
  error_file: <N/A>
"""
ROOT_CAUSE = "Root Cause (first observed failure):\n[0]:\n" + FAILURE


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


def _failed_together(root_cause_time: str) -> list[str]:
    """torchrun's report of rank 1 failing at 07:51:08 and its root cause, rank 0, at ``root_cause_time``."""
    rank1 = FAILURE.format(rank=1, code=1).replace("2026-11-25_18:45:03", "2026-11-30_07:51:08")
    root = ROOT_CAUSE.format(rank=0, code=1).replace("2026-11-25_18:45:03", root_cause_time)
    return ["Failures:\n", "[1]:\n", *rank1.splitlines(keepends=True), *root.splitlines(keepends=True)]


def test_a_rank_that_died_of_its_peers_death_in_the_same_second_is_not_named_first():
    """torchrun times failures to the second and names the lowest rank among those it saw in one poll: here rank 0,
    which died of rank 1's exit (gloo's "Connection closed by peer") in the same second as rank 1's own error. The
    launcher names rank 1: among the tied ranks, the first whose traceback does not blame a peer."""
    worker_lines = ["tensoropt-rank1|Traceback (most recent call last):\n",
                    "tensoropt-rank1|ValueError: rank 1 broke on purpose\n",
                    "tensoropt-rank0|Traceback (most recent call last):\n",
                    "tensoropt-rank0|RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5853.\n"]
    output, _ = _read(worker_lines + _failed_together("2026-11-30_07:51:08"))
    assert output.first_failure() == (1, 1)
    # a second apart, torchrun's order stands: rank 0 failed first, whatever its error says
    apart, _ = _read(worker_lines + _failed_together("2026-11-30_07:51:07"))
    assert apart.first_failure() == (0, 1)
