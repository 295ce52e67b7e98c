"""SIGTERM to `shoal run` while a worker is stopped (SIGSTOP, a debugger): the forwarded
SIGTERM stays pending in the stopped worker until it runs again, so the agent must continue it
(SIGCONT) rather than wait out the whole grace period for a process that cannot act."""

import os
import signal
import time


from tests.support.shoal_run import WORKERS, ShoalRun, pid_alive

ENV_WORKER = str(WORKERS / "env_worker.py")
GRACE_S = 30


def test_a_stopped_worker_does_not_cost_the_grace_period():
    run = ShoalRun(["--nproc-per-node", "1", "--grace-period", str(GRACE_S), ENV_WORKER,
                    "--wait", "120"], name="stopped")
    with run:
        (pid,) = run.worker_pids(30)
        run.wait_for(r"rank 0 ready", 30)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        run.signal(signal.SIGTERM)
        assert run.wait(GRACE_S + 20) == 128 + signal.SIGTERM, run.tail()
        took = time.monotonic() - started
    assert not pid_alive(pid)
    assert took < GRACE_S / 3, f"shoal run took {took:.1f}s of the {GRACE_S}s grace period"
