"""Pieces of the node agent that need no rendezvous: the log tee, worker groups, exit texts."""

import io
import logging
import os
import re
import signal
import sys
import time

import pytest

from shoal.elastic.agent.logs import TAIL_LINES, LogTee, RepeatLimiter
from shoal.elastic.agent.workers import WorkerGroup, describe_exit
from shoal.elastic.agent.agent import WorkerSpec, default_node_id, python_argv
from shoal.elastic.agent.env import summary_text as _summary_text


def test_the_tee_prefixes_lines_keeps_the_tail_and_writes_the_raw_file(tmp_path):
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    console_out, console_err = io.StringIO(), io.StringIO()
    tee = LogTee(3, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), console_out=console_out,
                 console_err=console_err, to_console=True, log_path=str(tmp_path / "r3.log"))
    with os.fdopen(err_w, "wb") as err:
        err.write(b"boom \xff\nno newline at the end")
    deadline = time.monotonic() + 10
    while "no newline at the end" not in tee.tail() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tee.tail() == ["boom \ufffd", "no newline at the end"]
    with os.fdopen(out_w, "wb") as out:
        out.write(b"".join(b"line %d\n" % i for i in range(TAIL_LINES + 5)))
    tee.join(5)
    assert console_out.getvalue().splitlines()[0] == "[rank 3] line 0"
    assert console_err.getvalue() == "[rank 3] boom \ufffd\n[rank 3] no newline at the end\n"
    assert tee.tail() == [f"line {i}" for i in range(5, TAIL_LINES + 5)]
    text = (tmp_path / "r3.log").read_bytes()
    assert text.startswith(b"boom \xff\nno newline at the end\nline 0\n") and b"[rank" not in text


def test_exit_descriptions_name_signals():
    assert describe_exit(-9) == "signal SIGKILL (exit code -9)"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "still running"


def test_a_worker_group_reports_failures_first_and_stops_the_rest():
    code = ("import os, sys, time\n"
            "r = int(os.environ['RANK'])\n"
            "print('rank', r, 'up', flush=True)\n"
            "time.sleep(0.2) if r == 1 else time.sleep(60)\n"
            "sys.exit(5)\n")
    envs = [dict(os.environ, RANK=str(r)) for r in (0, 1)]
    group = WorkerGroup([sys.executable, "-c", code], envs, [0, 1], log_paths=[None, None],
                        to_console=False, multiproc_dir=None)
    group.start()
    deadline = time.monotonic() + 30
    while group.state() == "running" and time.monotonic() < deadline:
        group.changed.wait(1.0)
        group.changed.clear()
    assert group.state() == "failed"
    [failure] = group.failures()
    assert (failure.rank, failure.exitcode, failure.tail) == (1, 5, ("rank 1 up",))
    started = time.monotonic()
    group.stop(grace=5.0)
    assert time.monotonic() - started < 5.0  # SIGTERM ended rank 0 at once
    assert group.counts() == {"running": 0, "succeeded": 0, "failed": 1, "stopped": 1}
    assert group.failures()[0].rank == 1  # a stopped worker is no failure


def test_summary_names_rank_exit_and_last_lines():
    text = _summary_text("job", {"rank": 3, "local_rank": 1, "node": "n1", "pid": 42,
                                 "exit": describe_exit(-signal.SIGKILL), "round": 2,
                                 "tail": ["a", "b"], "log_path": "/logs/rank_3.log"}, 2, 2)
    assert "job 'job' failed after 2 restart(s) (--max-restarts 2)" in text
    assert "rank 3 (local rank 1 on node n1, pid 42) ended with signal SIGKILL" in text
    assert text.endswith("Last lines of its log (/logs/rank_3.log):\n    a\n    b")


def test_worker_spec_and_argv():
    with pytest.raises(ValueError, match="nproc_per_node must be >= 1"):
        WorkerSpec(argv=("x",), nproc_per_node=0, run_id="r", checkpoint_dir="/c",
                   auth_token="t", local_addr="127.0.0.1", max_restarts=0)
    assert python_argv("train.py", ["--a"]) == (sys.executable, "-u", "train.py", "--a")
    assert python_argv("pkg.mod", [], module=True)[-2:] == ("-m", "pkg.mod")
    # Node ranks order node ids, and so the group ranks the rendezvous assigns.
    assert sorted([default_node_id(10), default_node_id(2)])[0].startswith("n00002-")


def test_repeated_warnings_are_held_back_and_counted(caplog):
    log = logging.getLogger("test.repeat")
    limiter = RepeatLimiter(log, every=0.2)
    with caplog.at_level(logging.WARNING, logger="test.repeat"):
        for _ in range(50):
            limiter.warning("the store does not answer")
        time.sleep(0.25)
        limiter.warning("the store does not answer")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "the store does not answer"
    assert re.fullmatch(r"the store does not answer \(49 more like it in the last 0s\)", lines[1])
    assert len(lines) == 2
