"""`shoal run` on etcd when etcd stops or dies during a job: a paused etcd (SIGSTOP 3 s) costs
nothing, a dead one keeps a finished agent for a few seconds at most, and SIGTERM ends an agent
(and its workers) within its grace period whatever etcd call it is waiting on."""

import os
import signal
import time
import uuid

import pytest

from tests.support.shoal_run import WORKERS, ShoalRun, pid_alive

ENV_WORKER = str(WORKERS / "env_worker.py")
FAIL_ON_FILE = str(WORKERS / "fail_on_file.py")
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"
# Finishing (exit barrier, closing the rendezvous, leaving) with etcd gone: at most this long.
EXIT_BOUND_S = 15.0
# SIGTERM to exit, with the default --grace-period of 5 s.
SIGTERM_BOUND_S = 10.0


def _node(etcd, worker: list) -> ShoalRun:
    return ShoalRun(["--nproc-per-node", "1", "--max-restarts", "1",
                     "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint,
                     "--rdzv-id", f"outage-{uuid.uuid4().hex[:8]}", "--rdzv-conf", RDZV_CONF]
                    + worker, name="node")


@pytest.mark.slow
def test_a_3s_pause_of_etcd_costs_nothing(etcd):
    with _node(etcd, [ENV_WORKER, "--wait", "5"]) as run:
        run.wait_for(r"rank 0 ready", 30)
        etcd.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(3.0)  # the outage itself
        finally:
            etcd.proc.send_signal(signal.SIGCONT)
        assert run.wait(30) == 0, run.tail()
    assert "Restarting the job" not in run.output


@pytest.mark.slow
def test_a_finished_job_exits_soon_although_etcd_died(etcd):
    with _node(etcd, [ENV_WORKER, "--wait", "2"]) as run:
        run.wait_for(r"rank 0 ready", 30)
        etcd.kill()
        killed = time.monotonic()
        code = run.wait(2 + EXIT_BOUND_S + 10)
        took = time.monotonic() - killed
    assert code == 0, run.tail()
    assert took < 2 + EXIT_BOUND_S, f"the agent needed {took:.1f}s:\n{run.tail()}"


@pytest.mark.slow
@pytest.mark.parametrize("outage", ["killed", "stopped"])
def test_sigterm_ends_the_agent_in_time_while_etcd_is_away_after_a_failure(
        etcd, tmp_path, outage):
    fail_file = tmp_path / "fail-now"
    with _node(etcd, [FAIL_ON_FILE, "--fail-file", str(fail_file)]) as run:
        pids = run.worker_pids(30)
        run.wait_for(r"rank 0 ready", 30)
        if outage == "killed":
            etcd.kill()
        else:
            etcd.proc.send_signal(signal.SIGSTOP)
        try:
            fail_file.write_text("")
            run.wait_for(r"fails on purpose", 10)
            # The agent is now in its failure path, blocked on etcd.
            run.wait_for(r"Round 0: rank 0 .* ended with exit code 3", 10)
            run.signal(signal.SIGTERM)
            sent = time.monotonic()
            code = run.wait(SIGTERM_BOUND_S + 20)
            took = time.monotonic() - sent
        finally:
            if outage == "stopped":
                etcd.proc.send_signal(signal.SIGCONT)
    assert code == 128 + signal.SIGTERM, run.tail()
    assert took < SIGTERM_BOUND_S, f"SIGTERM took {took:.1f}s:\n{run.tail()}"
    assert not any(pid_alive(p) for p in pids)


# A worker lost while etcd is already dead: the failure path (settling, claiming the round,
# counting the restart, signalling it) and the join after it share one join_outage_timeout,
# counted from the first call etcd did not answer. The margin covers the agent's own exit
# (stopping the workers, EXIT_BUDGET_S = 8 s of capped calls to leave) and a loaded machine.
OUTAGE_S = 10.0
OUTAGE_MARGIN_S = 12.0


@pytest.mark.slow
def test_a_lost_worker_while_etcd_is_dead_ends_the_agent_within_the_outage_budget(etcd, tmp_path):
    conf = f"{RDZV_CONF},join_outage_timeout={OUTAGE_S:g}"
    run = ShoalRun(["--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "etcd",
                    "--rdzv-endpoint", etcd.endpoint, "--rdzv-id",
                    f"outage-{uuid.uuid4().hex[:8]}", "--rdzv-conf", conf,
                    ENV_WORKER, "--wait", "60"], name="node")
    with run:
        pids = run.worker_pids(30)
        run.wait_for(r"rank 0 ready", 30)
        run.wait_for(r"joined round 0 ", 5)
        etcd.kill()
        time.sleep(1.0)  # etcd is gone before the worker is
        os.kill(pids[0], signal.SIGKILL)
        lost = time.monotonic()
        code = run.wait(OUTAGE_S + OUTAGE_MARGIN_S + 120)
        took = time.monotonic() - lost
    assert code == 1, run.tail()
    assert took < OUTAGE_S + OUTAGE_MARGIN_S, f"the agent needed {took:.1f}s:\n{run.tail()}"
    gave_up = [line for line in run.lines() if "unreachable for" in line]
    assert gave_up, run.tail()
    # The node ran round 0 and then waited to meet again: round 0 is the one to name.
    assert "to meet again after round 0 of run" in gave_up[-1], run.tail()
