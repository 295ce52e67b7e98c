"""A hung worker (SIGSTOPped) under `shoal run --collective-timeout`: the group times out in
seconds, the agent blames the rank that hung (not the one whose watchdog noticed), says where
the watchdog dump went, and the job recovers; with no restarts left, the failure summary and
the agent's error file name the hung rank and the dump."""

import json
import os
import re
import signal

import pytest

from tests.support.shoal_run import WORKERS, ShoalRun

LOOP = str(WORKERS / "allreduce_loop.py")


def _hang_rank_1(run) -> int:
    """Stop rank 1 once both ranks run; its pid (SIGKILL it when done)."""
    pids = run.worker_pids(30)
    run.wait_for(r"rank 1 group timeout 3s \(restart 0\)", 30)
    run.wait_for(r"rank 1 step 5 ", 30)
    os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs; rank 0's all_reduce waits for it
    return pids[1]


def _run_with_a_hang(args, env) -> tuple[ShoalRun, int]:
    with ShoalRun(args, env=env, name="job") as run:
        stopped = _hang_rank_1(run)
        try:
            code = run.wait(40)
        finally:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return run, code


def _check_dump(path: str, dumps) -> None:
    """The dump the agent named exists where SHOAL_DUMP_DIR points and is rank 0's record of
    an all_reduce that rank 1 never joined."""
    assert os.path.dirname(path) == str(dumps), path
    with open(path) as f:
        doc = json.load(f)
    assert doc["rank"] == 0 and doc["failed_op"]["op"] == "all_reduce"
    assert doc["progress_of_ranks"]["1"][1] < doc["failed_op"]["seq"]  # rank 1 never finished


@pytest.mark.slow
def test_a_stopped_worker_is_blamed_by_rank_and_the_job_recovers(tmp_path):
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--collective-timeout", "3", "--grace-period", "1", LOOP]
    env = {"SHOAL_DUMP_DIR": str(tmp_path / "dumps")}
    run, code = _run_with_a_hang(args, env)
    assert code == 0, run.tail()
    blame = re.search(r"Round 0: rank 1 hung: Rank 0 timed out after 3s in all_reduce #\d+ of "
                      r"group 'default': rank 1 (never arrived|did not finish)[^\n]*\(rank 0 "
                      r"noticed and ended with exit code 75\)\. Watchdog dump: (\S+)",
                      run.output)
    assert blame, run.tail()
    _check_dump(blame.group(2), tmp_path / "dumps")
    assert re.search(r"rank 1 hung: rank 0 on node \S+ timed out waiting for it", run.output)
    assert "rank 0 done after restart 1" in run.output and "rank 1 done after restart 1" in run.output


@pytest.mark.slow
def test_with_no_restarts_left_the_summary_and_error_file_name_the_dump(tmp_path):
    agent_file = tmp_path / "termination-log"
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "--collective-timeout", "3", "--grace-period", "1", LOOP]
    env = {"SHOAL_DUMP_DIR": str(tmp_path / "dumps"),
           "TORCHELASTIC_ERROR_FILE": str(agent_file)}
    run, code = _run_with_a_hang(args, env)
    assert code == 1, run.tail()
    assert re.search(r"The failing worker: rank 1 \(local rank 1 on node \S+, pid \d+\) hung "
                     r"in round 0", run.output), run.tail()
    dump = re.search(r"^Watchdog dump: (\S+)$", run.output, re.M)
    assert dump, run.tail()
    _check_dump(dump.group(1), tmp_path / "dumps")
    doc = json.loads(agent_file.read_text())
    assert doc["shoal"]["rank"] == 1 and doc["shoal"]["dump_path"] == dump.group(1)
    assert doc["shoal"]["culprits"] == [1] and doc["shoal"]["detected_by"] == 0
