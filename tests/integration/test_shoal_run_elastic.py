"""`shoal run` jobs of examples/train_ddp.py under faults, on the embedded store and on a real
etcd: a SIGKILLed worker, a SIGKILLed agent, a node joining late, an etcd outage, exhausted
restarts and a kill inside a checkpoint save. Every job runs as real processes."""

import os
import re
import signal
import time
import uuid

import pytest

from tests.support.shoal_run import (
    TRAIN_DDP,
    WORKERS,
    ShoalRun,
    check_resume,
    final_sha,
    pid_alive,
    steps_run,
)

STEPS, EVERY = 40, 5
TRAIN = [str(TRAIN_DDP), "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
# Short heartbeats so a dead agent is noticed in about 2 s.
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"
JOB_TIMEOUT = 90


def _pair(backend, request, tmp_path, worker, *, nnodes="2", nproc="2", late_b=False):
    """Node A (node rank 0) and node B of one job; B is None when `late_b` (start it later)."""
    run_id = f"job-{uuid.uuid4().hex[:8]}"
    base = ["--nnodes", nnodes, "--nproc-per-node", nproc, "--max-restarts", "3",
            "--rdzv-id", run_id, "--rdzv-conf", RDZV_CONF,
            "--checkpoint-dir", str(tmp_path / "checkpoints")]
    if backend == "etcd":
        endpoint = request.getfixturevalue("etcd").endpoint
        a_args = base + ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--node-rank", "0"]
        b_args = base + ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--node-rank", "1"]
        a = ShoalRun(a_args + worker, name="node A")
    else:
        a = ShoalRun(base + ["--rdzv-endpoint", "127.0.0.1:0", "--node-rank", "0"] + worker,
                     name="node A")
        b_args = base + ["--rdzv-endpoint", f"127.0.0.1:{a.store_port()}", "--node-rank", "1"]
    start_b = lambda: ShoalRun(b_args + worker, name="node B")  # noqa: E731
    return a, (start_b if late_b else start_b())


@pytest.fixture(scope="module")
def reference_sha(tmp_path_factory):
    """The parameters of an uninterrupted run of the same job (4 ranks)."""
    ck = tmp_path_factory.mktemp("reference")
    with ShoalRun(["--standalone", "--nproc-per-node", "4", "--checkpoint-dir", str(ck)] + TRAIN,
                  name="reference") as run:
        assert run.wait(JOB_TIMEOUT) == 0, run.tail()
    return final_sha(run, STEPS)


@pytest.mark.parametrize("backend", ["store", "etcd"])
def test_two_nodes_form_one_group_and_resume_after_a_sigkilled_worker(
        backend, request, tmp_path, reference_sha):
    a, b = _pair(backend, request, tmp_path, TRAIN + ["--step-sleep", "0.05"])
    with a, b:
        a.wait_for(r"\[rank 0\] step 12 ", JOB_TIMEOUT)
        victim = b.worker_pids(5)[1]  # rank 3, on node B
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pytest.fail(f"rank 3 (pid {victim}) is gone before the kill:\n{a.tail()}\n{b.tail()}")
        assert a.wait(JOB_TIMEOUT) == 0, a.tail()
        assert b.wait(JOB_TIMEOUT) == 0, b.tail()
    assert "runs ranks [0, 1] of 4 (restart 0)" in a.output  # one group of 2 x 2
    assert "runs ranks [2, 3] of 4 (restart 0)" in b.output
    assert f"rank 3 (local rank 1, pid {victim}) ended with signal SIGKILL" in b.output
    assert "runs ranks [0, 1] of 4 (restart 1)" in a.output
    check_resume(a, 1, STEPS, EVERY)
    assert final_sha(a, STEPS) == reference_sha  # exactly the uninterrupted run's parameters


def test_a_killed_agent_leaves_the_others_running_at_the_smaller_size(request, tmp_path):
    a, b = _pair("etcd", request, tmp_path, TRAIN + ["--step-sleep", "0.05"], nnodes="1:2")
    with a, b:
        a.wait_for(r"runs ranks \[0, 1\] of 4", JOB_TIMEOUT)
        # Past the first checkpoint (step 5) of the 2-node round:
        a.wait_for(r"\[rank 0\] step (?:[89]|[1-3]\d) ", JOB_TIMEOUT, start=a.last_index)
        b_workers = b.worker_pids(5)
        b.kill()  # SIGKILL the agent; its workers die with it
        assert a.wait(JOB_TIMEOUT) == 0, a.tail()
    assert not any(pid_alive(p) for p in b_workers)
    assert re.search(r"Round \d+: node rank 0 of 1 runs ranks \[0, 1\] of 2", a.output), a.tail()
    # A lost node costs no restart: the survivors' restart count stays 0.
    assert re.search(r"\[rank 0\] resumed from step \d+ \(restart 0\)", a.output), a.tail()
    final_sha(a, STEPS)


def test_a_node_joining_late_scales_the_job_up(request, tmp_path):
    a, start_b = _pair("store", request, tmp_path, TRAIN + ["--step-sleep", "0.05"],
                       nnodes="1:2", late_b=True)
    with a:
        a.wait_for(r"runs ranks \[0, 1\] of 2", JOB_TIMEOUT)
        a.wait_for(r"\[rank 0\] step 8 ", JOB_TIMEOUT)
        with start_b() as b:
            assert b.wait(JOB_TIMEOUT) == 0, b.tail()
            assert a.wait(JOB_TIMEOUT) == 0, a.tail()
    assert "a node is waiting to join: scaling up" in a.output
    assert re.search(r"runs ranks \[0, 1\] of 4", a.output)
    assert re.search(r"runs ranks \[2, 3\] of 4", b.output)
    check_resume(a, 0, STEPS, EVERY)  # scaling up costs no restart
    final_sha(a, STEPS)


def test_the_job_survives_etcd_stopping_for_three_seconds(request, tmp_path):
    etcd = request.getfixturevalue("etcd")
    a, b = _pair("etcd", request, tmp_path, TRAIN + ["--step-sleep", "0.15"], nproc="1")
    with a, b:
        a.wait_for(r"\[rank 0\] step 5 ", JOB_TIMEOUT)
        etcd.stop()
        time.sleep(3.0)  # the outage itself
        etcd.start()
        assert a.wait(JOB_TIMEOUT) == 0, a.tail()
        assert b.wait(JOB_TIMEOUT) == 0, b.tail()
    assert "Restarting the job" not in a.output + b.output
    assert steps_run(a.lines()) == list(range(1, STEPS + 1))  # no step lost or repeated
    final_sha(a, STEPS)


def test_exhausted_restarts_on_etcd_end_with_the_summary(request, tmp_path):
    worker = [str(WORKERS / "env_worker.py"), "--fail-rank", "0", "--fail-attempts", "99",
              "--exit-code", "9"]
    a, b = _pair("etcd", request, tmp_path, worker, nproc="1")
    with a, b:
        codes = (a.wait(JOB_TIMEOUT), b.wait(JOB_TIMEOUT))
    assert all(code != 0 for code in codes), (a.tail(), b.tail())
    for run in (a, b):
        assert "failed after 3 restart(s) (--max-restarts 3)" in run.output, run.tail()
        assert re.search(r"The failing worker: rank 0 \(local rank 0 on node n00000-\S+, "
                         r"pid \d+\) ended with exit code 9 in round \d+", run.output)
        assert "    rank 0 fails on purpose with exit code 9" in run.output


def test_a_kill_inside_a_checkpoint_save_resumes_from_the_previous_one(tmp_path, reference_sha):
    args = ["--standalone", "--nproc-per-node", "4", "--checkpoint-dir", str(tmp_path / "ck"),
            str(WORKERS / "kill_in_save.py"), *TRAIN[1:], "--kill-at-save", "10"]
    with ShoalRun(args, name="job") as run:
        assert run.wait(JOB_TIMEOUT) == 0, run.tail()
    assert "killing rank 0 inside the save of step 10" in run.output
    assert check_resume(run, 1, STEPS, EVERY) == 5  # step 10's file never appeared
    assert final_sha(run, STEPS) == reference_sha
