"""The agent's workers (elastic.agent.workers.WorkerGroup), started as real processes: each is
this process's child with SIGKILL as its parent-death signal (so it dies with a SIGKILLed
agent), runs its command line and environment unchanged, and a program that does not exist is an error naming
the rank before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shoal.elastic.agent.workers import WorkerGroup

# What the worker reports: its parent, its parent-death signal (prctl PR_GET_PDEATHSIG), argv,
# its environment.
REPORT = ("import ctypes, json, os, sys; v = ctypes.c_int(); "
          "ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(v), 0, 0, 0); "
          "print(json.dumps([os.getppid(), v.value, sys.argv[1:], dict(os.environ)]), "
          "flush=True)")
# A worker environment without PWD, which a shell would add.
ENV = {k: v for k, v in os.environ.items() if k != "PWD"}


def _group(argv, tmp_path, n=1):
    return WorkerGroup(argv, [ENV] * n, list(range(n)),
                       log_paths=[str(tmp_path / f"rank{r}.log") for r in range(n)],
                       to_console=False, multiproc_dir=None)


def test_a_worker_is_our_child_and_dies_with_us(tmp_path):
    group = _group([sys.executable, "-c", REPORT, "a b", "$HOME"], tmp_path, n=2)
    group.start()
    try:
        end = time.monotonic() + 30
        while group.state() == "running" and time.monotonic() < end:
            group.changed.wait(0.1)
            group.changed.clear()
        assert group.state() == "succeeded", group.counts()
        group.wait_output()
    finally:
        group.stop(grace=1.0)
    # The same command started directly: the environment Python itself shows for what it got.
    direct = subprocess.run([sys.executable, "-c", REPORT], env=ENV, capture_output=True,
                            text=True, timeout=30)
    expected_env = json.loads(direct.stdout)[3]
    for rank in range(2):
        parent, deathsig, args, env = json.loads((tmp_path / f"rank{rank}.log").read_text())
        assert parent == os.getpid()
        assert deathsig == signal.SIGKILL
        assert args == ["a b", "$HOME"]  # passed through verbatim, no shell expansion
        assert env == expected_env


def test_a_missing_program_is_an_error_naming_the_rank(tmp_path):
    group = _group([str(tmp_path / "no-such-python"), "script.py"], tmp_path)
    with pytest.raises(OSError, match="Cannot start rank 0"):
        group.start()
