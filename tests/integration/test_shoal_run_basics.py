"""`shoal run` as a real subprocess with small store-only workers: environment, output,
restarts, the failure summary and signal forwarding."""

import json
import re
import signal
import subprocess
import sys
import time

from tests.support.shoal_run import ROOT, WORKERS, ShoalRun, pid_alive

ENV_WORKER = str(WORKERS / "env_worker.py")


def _envs(run: ShoalRun) -> list[dict]:
    found = []
    for line in run.lines():
        match = re.match(r"\[rank (\d+)\] ENV (.*)$", line)
        if match:
            env = json.loads(match.group(2))
            assert env["RANK"] == match.group(1)  # the console prefix names the right rank
            found.append(env)
    return found


def test_one_command_runs_a_group_with_torchruns_environment(tmp_path):
    run = ShoalRun(["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "--tee",
                    ENV_WORKER], env={"SHOAL_AUTH_TOKEN": "basics-token"})
    assert run.wait(60) == 0, run.tail()
    envs = sorted(_envs(run), key=lambda e: e["RANK"])
    assert [e["RANK"] for e in envs] == ["0", "1"]
    for local, env in enumerate(envs):
        assert env["LOCAL_RANK"] == str(local) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
        assert env["SHOAL_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["SHOAL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["SHOAL_AUTH_TOKEN"] == "basics-token"
        assert env["SHOAL_CHECKPOINT_DIR"] and env["PROMETHEUS_MULTIPROC_DIR"]
        assert env["sum"] == 1  # both ranks met in the agent's store: 0 + 1
    assert "[rank 1] rank 1 says hello on stderr" in run.output
    logs = sorted((tmp_path / "logs").rglob("rank_*.log"))
    assert [p.name for p in logs] == ["rank_0.log", "rank_1.log"]
    assert "rank 1 says hello on stderr" in logs[1].read_text()
    assert not logs[1].read_text().startswith("[rank")  # files hold the raw output


def test_a_failed_worker_restarts_the_group_within_the_budget():
    run = ShoalRun(["--nproc-per-node", "2", "--max-restarts", "2", ENV_WORKER,
                    "--fail-rank", "1"])
    assert run.wait(60) == 0, run.tail()
    counts = sorted((e["RANK"], e["SHOAL_RESTART_COUNT"]) for e in _envs(run))
    assert counts == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert "rank 1 (local rank 1" in run.output and "exit code 3" in run.output


def test_exhausted_restarts_end_every_node_with_the_summary():
    args = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1",
            "--rdzv-id", "exhausted"]
    worker = [ENV_WORKER, "--fail-rank", "3", "--fail-attempts", "99", "--exit-code", "7"]
    host = ShoalRun(args + ["--rdzv-endpoint", "127.0.0.1:0"] + worker, name="node A")
    with host:
        other = ShoalRun(args + ["--rdzv-endpoint", f"127.0.0.1:{host.store_port()}"] + worker,
                         name="node B")
        with other:
            assert other.wait(60) != 0, other.tail()
            assert host.wait(60) != 0, host.tail()
    for run in (host, other):
        out = run.output
        assert "failed after 1 restart(s) (--max-restarts 1)" in out, out
        assert re.search(r"The failing worker: rank 3 \(local rank 1 on node \S+, pid \d+\) "
                         r"ended with exit code 7 in round 1", out), out
        assert "Last lines of its log" in out
        assert "    rank 3 fails on purpose with exit code 7" in out


def test_sigterm_and_sigint_are_forwarded_and_stubborn_workers_killed_after_the_grace_period():
    polite = ShoalRun(["--nproc-per-node", "2", ENV_WORKER, "--on-sigterm", "exit",
                       "--wait", "60"], name="polite")
    stubborn = ShoalRun(["--nproc-per-node", "1", "--grace-period", "0.5", ENV_WORKER,
                         "--on-sigterm", "ignore", "--wait", "60"], name="stubborn")
    interrupted = ShoalRun(["--nproc-per-node", "1", ENV_WORKER, "--wait", "60"],
                           name="interrupted")
    with polite, stubborn, interrupted:
        pids = polite.worker_pids(30) + stubborn.worker_pids(30) + interrupted.worker_pids(30)
        polite.wait_for(r"rank 1 ready", 30)
        polite.wait_for(r"rank 0 ready", 30)
        stubborn.wait_for(r"rank 0 ready", 30)
        interrupted.wait_for(r"rank 0 ready", 30)
        started = time.monotonic()
        polite.signal(signal.SIGTERM)
        stubborn.signal(signal.SIGTERM)
        interrupted.signal(signal.SIGINT)  # as Ctrl-C would
        assert polite.wait(30) == 128 + signal.SIGTERM
        assert stubborn.wait(30) == 128 + signal.SIGTERM
        assert interrupted.wait(30) == 128 + signal.SIGINT
        assert time.monotonic() - started < 10
    assert "[rank 0] KeyboardInterrupt" in interrupted.output  # the worker got the SIGINT
    assert "[rank 0] rank 0 got SIGTERM" in polite.output
    assert "[rank 1] rank 1 got SIGTERM" in polite.output
    assert "outlived the 0.5s grace period; sending SIGKILL" in stubborn.output
    assert not any(pid_alive(p) for p in pids)


def test_nodes_meet_through_a_standalone_shoal_store(tmp_path):
    store = subprocess.Popen([sys.executable, "-m", "shoal.launcher", "store", "--port", "0"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = store.stdout.readline()
        match = re.match(r"shoal store listening on 127\.0\.0\.1:(\d+)$", line.strip())
        assert match, line
        args = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{match.group(1)}",
                "--rdzv-id", "via-store", ENV_WORKER]
        with ShoalRun(args, name="node A") as a, ShoalRun(args, name="node B") as b:
            assert a.wait(60) == 0, a.tail()
            assert b.wait(60) == 0, b.tail()
        envs = _envs(a) + _envs(b)
        assert sorted(e["RANK"] for e in envs) == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["sum"] for e in envs} == {1}
        assert "Rendezvous store listening" not in a.output + b.output  # neither hosted one
        assert store.poll() is None  # the store outlives the job
        store.send_signal(signal.SIGTERM)
        assert store.wait(10) == 0
    finally:
        store.kill()
        store.wait(10)


def test_the_secret_comes_from_the_token_file_or_is_made_per_job(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    with ShoalRun(["--nproc-per-node", "2", "--auth-token-file", str(token_file), ENV_WORKER],
                  env={"SHOAL_AUTH_TOKEN": "from-the-environment"}) as run:
        assert run.wait(60) == 0, run.tail()
    assert {e["SHOAL_AUTH_TOKEN"] for e in _envs(run)} == {"from-the-file"}
    with ShoalRun(["--nproc-per-node", "2", ENV_WORKER], env={"SHOAL_AUTH_TOKEN": ""}) as run:
        assert run.wait(60) == 0, run.tail()
    tokens = {e["SHOAL_AUTH_TOKEN"] for e in _envs(run)}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{64}", tokens.pop())


def test_a_log_dir_holding_a_file_named_as_the_run_id_is_a_usage_error(tmp_path):
    """The agent writes <log dir>/<run id>/round_N/...: a file in its place is refused at once
    with a sentence naming it (it was a NotADirectoryError traceback in the first round)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "job7").write_text("not a directory")
    run = ShoalRun(["--nproc-per-node", "1", "--rdzv-id", "job7", "--log-dir", str(logs),
                    ENV_WORKER], env={"SHOAL_AUTH_TOKEN": "basics-token"})
    assert run.wait(30) == 2, run.tail()
    assert "shoal run: error: cannot create the job's directories: [Errno 17] File exists: " \
           f"'{logs / 'job7'}'" in run.output, run.tail()
    assert "Traceback" not in run.output
