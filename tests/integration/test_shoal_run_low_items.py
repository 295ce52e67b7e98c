"""`shoal run`'s messages for three mistakes of issue 34: a placeholder secret (reported as the
placeholder, not as an unreachable store), a metrics endpoint on every interface without
TLS or authentication (a warning), and a master port that accepts but never answers (the
address named at once, an error within the store timeout)."""

import os
import socket
import subprocess
import sys
import time

from tests.support.shoal_run import ROOT, WORKERS, ShoalRun

ENV_WORKER = str(WORKERS / "env_worker.py")


def _run(args, env, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.launcher", "run", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "MASTER_"))}
    env.update(extra)
    return env


def test_a_placeholder_secret_is_named_as_such_not_as_an_unreachable_store(tmp_path):
    done = _run(["--standalone", "--nproc-per-node", "1", ENV_WORKER],
                _env(SHOAL_AUTH_TOKEN="change-me"))
    assert done.returncode == 2, done.stderr
    assert "SHOAL_AUTH_TOKEN: The auth token is the placeholder 'change-me'" in done.stderr
    assert "cannot reach" not in done.stderr
    token_file = tmp_path / "token"
    token_file.write_text("REPLACE-WITH-OUTPUT-OF-openssl-rand-hex-32\n")
    done = _run(["--standalone", "--nproc-per-node", "1", "--auth-token-file", str(token_file),
                 ENV_WORKER], _env())
    assert done.returncode == 2, done.stderr
    assert "--auth-token-file" in done.stderr and "placeholder" in done.stderr
    assert "cannot reach" not in done.stderr


def test_metrics_on_every_interface_without_a_web_config_warn_once():
    env = _env(SHOAL_AUTH_TOKEN="low-items-" + "x" * 32)
    done = _run(["--standalone", "--nproc-per-node", "1", "--metrics-host", "0.0.0.0",
                 "--metrics-port", "0", ENV_WORKER], env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert out.count("without TLS or authentication") == 1, out
    assert "anyone who can reach this machine" in out and "SHOAL_METRICS_WEB_CONFIG" in out
    done = _run(["--standalone", "--nproc-per-node", "1", "--metrics-port", "0", ENV_WORKER],
                env)
    assert done.returncode == 0 and "without TLS" not in done.stdout + done.stderr


def test_a_master_port_that_never_answers_is_named_at_once_and_fails_within_the_timeout():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes connections; nobody ever answers them
    port = silent.getsockname()[1]
    run = ShoalRun(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), "--rdzv-conf", "store_timeout=6",
                    "--nproc-per-node", "1", ENV_WORKER],
                   env=_env(SHOAL_AUTH_TOKEN="low-items-" + "x" * 32), name="silent")
    started = time.monotonic()
    with run, silent:
        run.wait_for(rf"Joining the static rendezvous at 127\.0\.0\.1:{port} .*6s to answer", 10)
        assert time.monotonic() - started < 10
        assert run.wait(30) == 1, run.tail()
        took = time.monotonic() - started
    assert took < 6 + 10, took
    assert f"127.0.0.1:{port}" in run.output.splitlines()[-1], run.tail()
