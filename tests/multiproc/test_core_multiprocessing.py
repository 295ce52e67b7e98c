"""core.multiprocessing.spawn: torch.multiprocessing.spawn's semantics with real child processes."""

import os
import signal
import time

import pytest

import shoal.core.multiprocessing as mp


def _write_rank(i, out_dir, tag):
    with open(os.path.join(out_dir, f"{i}.txt"), "w") as fh:
        fh.write(f"{tag}:{i}")


def _rank1_raises(i, out_dir):
    if i == 1:
        raise ValueError(f"rank {i} found a bad batch")
    time.sleep(60)  # rank 0 is stopped by the parent once rank 1 fails


def _rank0_killed(i):
    if i == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _exit_code_3(i):
    raise SystemExit(3)


def _sleep_forever(i):
    time.sleep(60)


def test_spawn_runs_fn_with_rank_and_args(tmp_path):
    assert mp.spawn(_write_rank, args=(str(tmp_path), "hello"), nprocs=2, timeout=60) is None
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["hello:0", "hello:1"]


def test_a_raising_child_reraises_with_its_traceback_and_stops_the_others(tmp_path):
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_rank1_raises, args=(str(tmp_path),), nprocs=2, timeout=60)
    err = info.value
    assert err.error_index == 1 and isinstance(err.error_pid, int)
    assert "\n\n-- Process 1 terminated with the following error:\nTraceback" in str(err)
    assert "in _rank1_raises" in str(err)
    assert str(err).rstrip().endswith("ValueError: rank 1 found a bad batch")
    assert time.monotonic() - start < 30  # rank 0's 60 s sleep was cut short


def test_signal_and_exit_code_are_named():
    with pytest.raises(mp.ProcessExitedException, match=r"^process 0 terminated with signal "
                                                        r"SIGKILL$") as info:
        mp.spawn(_rank0_killed, nprocs=2, timeout=60)
    assert info.value.signal_name == "SIGKILL" and info.value.exit_code == -signal.SIGKILL
    with pytest.raises(mp.ProcessExitedException, match=r"^process 0 terminated with exit code 3$"):
        mp.spawn(_exit_code_3, nprocs=1, timeout=60)


def test_join_false_returns_a_context_and_timeout_stops_the_run():
    ctx = mp.spawn(_sleep_forever, nprocs=2, join=False)
    assert ctx.join(timeout=0.2) is False  # still running: torch's join(timeout) contract
    assert len(ctx.pids()) == 2
    ctx.stop(grace_period=1.0)
    assert all(not p.is_alive() for p in ctx.processes)
    with pytest.raises(mp.ProcessTimeoutError, match=r"spawn: process\(es\) 0, 1 of 2 still "
                                                     r"running after 0.5s; stopped them"):
        mp.spawn(_sleep_forever, nprocs=2, timeout=0.5)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"spawn: nprocs must be a positive int, got 0\."):
        mp.spawn(_write_rank, nprocs=0)
    with pytest.raises(ValueError, match=r"spawn: start_method must be one of \('spawn', 'fork', "
                                         r"'forkserver'\), got 'thread'\."):
        mp.spawn(_write_rank, start_method="thread")
    with pytest.raises(TypeError, match=r"spawn: fn must be callable, got int\."):
        mp.spawn(3)


def test_torch_raises_the_same_exception_shapes():
    """torch.multiprocessing.spawn as the oracle for the messages of raised and killed ranks."""
    tmp = pytest.importorskip("torch.multiprocessing")
    with pytest.raises(tmp.ProcessExitedException) as theirs:
        tmp.spawn(_exit_code_3, nprocs=1)
    with pytest.raises(mp.ProcessExitedException) as ours:
        mp.spawn(_exit_code_3, nprocs=1, timeout=60)
    assert str(ours.value) == str(theirs.value)
    assert (ours.value.exit_code, ours.value.error_index) == (theirs.value.exit_code,
                                                               theirs.value.error_index)
