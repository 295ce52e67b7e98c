"""A hung worker (SIGSTOPped) under `shoal run --collective-timeout`: the group times out in
seconds, the agent blames the rank that hung (not the one whose watchdog noticed), and the job
recovers."""

import os
import re
import signal

import pytest

from tests.support.shoal_run import WORKERS, ShoalRun

LOOP = str(WORKERS / "allreduce_loop.py")


@pytest.mark.slow
def test_a_stopped_worker_is_blamed_by_rank_and_the_job_recovers(tmp_path):
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--collective-timeout", "3", "--grace-period", "1", LOOP]
    env = {"SHOAL_DUMP_DIR": str(tmp_path / "dumps")}
    with ShoalRun(args, env=env, name="job") as run:
        pids = run.worker_pids(30)
        run.wait_for(r"rank 1 group timeout 3s \(restart 0\)", 30)
        run.wait_for(r"rank 1 step 5 ", 30)
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs; rank 0's all_reduce waits for it
        try:
            code = run.wait(40)
        finally:
            try:
                os.kill(pids[1], signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert code == 0, run.tail()
    blame = re.search(rf"Round 0: rank 1 hung: Rank 0 timed out after 3s in all_reduce #\d+ of "
                      rf"group 'default': rank 1 (never arrived|did not finish)[^\n]*\(rank 0 "
                      rf"noticed and ended with exit code 75\)", run.output)
    assert blame, run.tail()
    assert re.search(r"rank 1 hung: rank 0 on node \S+ timed out waiting for it", run.output)
    assert "rank 0 done after restart 1" in run.output and "rank 1 done after restart 1" in run.output
