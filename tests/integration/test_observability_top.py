"""`shoal top` against a running job (rank 1 a deliberate straggler), in a real terminal: tmux
runs it, capture-pane reads the screen, send-keys quits it. The screen follows the job live:
the steps advance, and a killed worker shows as restarts 1/3 and failed 1 while the job
recovers. Also its text mode, its error for an endpoint that is not there, and its refusal to
send a basic auth password over plain http unless told to."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from shoal.elastic import metrics
from shoal.launcher.top import Access, clear_text_problem
from tests.support.requirements import missing
from tests.support.shoal_run import ROOT, WORKERS, ShoalRun


def _start_job(tmp_path, run_id: str):
    stop = tmp_path / "stop"
    args = ["--nproc-per-node", "2", "--metrics-port", "0", "--rdzv-id", run_id,
            "--checkpoint-dir", str(tmp_path / "ckpt"), str(WORKERS / "observed_job.py"),
            "--stop-file", str(stop), "--straggler", "1"]
    run = ShoalRun(args, name="observed job")
    port = int(run.wait_for(r"Metrics of this node's agent and workers at "
                            r"http://127\.0\.0\.1:(\d+)/metrics", 30).group(1))
    run.wait_for(r"\[rank 1\] rank 1 at step 10", 60)
    return run, stop, port


def _rows(screen: str) -> dict[str, str]:
    return {m.group(1): line for line in screen.splitlines()
            if (m := re.match(r"\s+(\d+)\s+\d+\s", line))}


def _steps(screen: str) -> dict[str, int]:
    """The STEP column, by rank."""
    return {rank: int(line.split()[1]) for rank, line in _rows(screen).items()}


class _Pane:
    """A tmux server of its own with one 80x24 window running `command`."""

    def __init__(self, tmux: str, command: str):
        self.t = [tmux, "-L", f"shoal-top-{uuid.uuid4().hex[:8]}"]
        subprocess.run(self.t + ["-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24",
                                 "-s", "top", command], check=True, timeout=10)

    def capture(self) -> str:
        return subprocess.run(self.t + ["capture-pane", "-p", "-t", "top"], check=True,
                              capture_output=True, text=True, timeout=10).stdout

    def wait_for(self, done, timeout: float, what: str) -> str:
        """Capture until `done(screen)`; fail with the last screen."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.capture()
            if done(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"shoal top never showed {what} in {timeout:g}s:\n{screen}")
            time.sleep(0.3)

    def keys(self, *keys: str) -> None:
        subprocess.run(self.t + ["send-keys", "-t", "top", *keys], check=True, timeout=10)

    def close(self) -> None:
        subprocess.run(self.t + ["kill-server"], capture_output=True, timeout=10)


def test_shoal_top_in_tmux_shows_ranks_the_straggler_and_a_restart_live(tmp_path):
    tmux = shutil.which("tmux")
    if tmux is None:
        missing("the terminal view test", "tmux is needed to drive shoal top in a real "
                "terminal (apt-get install tmux)")
    run, stop, port = _start_job(tmp_path, "topjob")
    done = tmp_path / "exited"
    pane = _Pane(tmux, f"cd {ROOT} && {sys.executable} -m shoal.launcher top 127.0.0.1:{port} "
                       f"--interval 0.5; echo $? > {done}")
    try:
        screen = pane.wait_for(lambda s: "<- straggler" in s and set(_rows(s)) == {"0", "1"},
                               20, "both ranks and the straggler")
        job = "run topjob  world 2  running 2  restarts 0/3  failed 0  last restart never"
        assert job in screen, screen
        rows = _rows(screen)
        assert rows["1"].endswith("<- straggler"), screen
        assert "straggler" not in rows["0"], screen
        # Rank 0 waits in collectives most of the time (for rank 1); rank 1 hardly at all.
        wait = {r: int(re.findall(r"(\d+)%", line)[0]) for r, line in rows.items()}
        assert wait["0"] > 50 > wait["1"], screen
        # The view is live: a later screen shows both ranks further on.
        before = _steps(screen)
        later = pane.wait_for(lambda s: set(_steps(s)) == {"0", "1"} and all(
            _steps(s)[r] > before[r] for r in before), 10, f"steps past {before}")
        assert "restarts 0/3  failed 0" in later, later

        # A failure: rank 0's worker is killed; the agent restarts both ranks from the last
        # checkpoint, and the same screen counts it without being restarted itself.
        os.kill(run.worker_pids(5)[0], signal.SIGKILL)
        restarted = pane.wait_for(lambda s: "running 2  restarts 1/3  failed 1  last restart "
                                  in s and set(_steps(s)) == {"0", "1"}, 40, "the restart")
        assert re.search(r"last restart \d+\.\ds ago", restarted), restarted
        after = _steps(restarted)
        pane.wait_for(lambda s: set(_steps(s)) == {"0", "1"} and all(
            _steps(s)[r] > after[r] for r in after), 20, f"steps past {after} after the restart")

        pane.keys("q")
        deadline = time.monotonic() + 10
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.exists() and done.read_text().strip() == "0"
    finally:
        pane.close()
        stop.touch()
        code = run.wait(60)
        run.kill()
    assert code == 0, run.tail()
    assert "Restarting the job (restart 1 of 3)" in run.output, run.tail()


def test_shoal_top_once_prints_text_and_refuses_a_dead_endpoint(tmp_path):
    run, stop, port = _start_job(tmp_path, "toponce")
    try:
        out = subprocess.run([sys.executable, "-m", "shoal.launcher", "top",
                              f"127.0.0.1:{port}", "--once", "--interval", "0.5"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("run toponce  world 2  running 2  restarts 0/3")
        assert lines[1].split() == ["RANK", "STEP", "STEP", "ms", "SMPL/s", "WAIT", "STEP",
                                    "AGO", "COLL", "AGO", "RSS", "MiB", "CPU"]
        assert set(_rows(out.stdout)) == {"0", "1"}
    finally:
        stop.touch()
        code = run.wait(60)
        run.kill()
    assert code == 0, run.tail()
    dead = subprocess.run([sys.executable, "-m", "shoal.launcher", "top", f"127.0.0.1:{port}",
                           "--once"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert dead.returncode == 1
    assert re.fullmatch(rf"shoal top: cannot read http://127\.0\.0\.1:{port}/metrics: "
                        r"\[Errno 111\] Connection refused\n", dead.stderr), dead.stderr


def _top_once(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shoal.launcher", "top", *args, "--once",
                           "--interval", "0.2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("target, url", [
    ("127.0.0.1:1", "http://127.0.0.1:1/metrics"),  # a bare HOST:PORT without TLS options
    ("http://127.0.0.1:1/metrics", "http://127.0.0.1:1/metrics"),
])
def test_shoal_top_refuses_to_send_a_password_over_plain_http(tmp_path, target, url):
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    refusal = (f"shoal top: error: --user 'prom' would send its password in clear text to "
               f"{url}: give an https:// endpoint (or a bare HOST:PORT with --cacert), or pass "
               "--allow-http-password to send it anyway.\n")
    # Refused before anything is sent (nothing listens on port 1; a fetch would exit 1).
    for extra, env in ((["--password-file", str(password)], None),
                       ([], {"SHOAL_METRICS_PASSWORD": "s3cret"})):
        done = _top_once(target, "--user", "prom", *extra, env=env)
        assert done.returncode == 2, done.stderr
        assert done.stderr.endswith(refusal), done.stderr
    # https, whatever its spelling, and no password at all are fine.
    assert clear_text_problem("HTTPS://h:1/metrics", Access(None, "Basic eDp5"), "x") is None
    assert clear_text_problem(url, Access(None, None), None) is None


def test_allow_http_password_sends_it_to_a_plain_http_endpoint(tmp_path):
    try:
        import bcrypt
    except ImportError:
        missing("the basic auth tests", "basic_auth_users needs bcrypt (pip install bcrypt; "
                "the test extra has it)")
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")  # basic auth, no TLS
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    metrics.set_run_id("plain-auth")
    server = metrics.MetricsServer("127.0.0.1", 0, None, web_config=str(config))
    try:
        assert server.url.startswith("http://")
        sent = _top_once(server.url, "--user", "prom", "--password-file", str(password),
                         "--allow-http-password")
        assert sent.returncode == 0, sent.stderr
        assert sent.stdout.startswith("run plain-auth  world ?"), sent.stdout
        # The endpoint does need the password: without it the same read is refused.
        bare = _top_once(server.url)
        assert bare.returncode == 1
        assert bare.stderr == f"shoal top: cannot read {server.url}: HTTP 401 Unauthorized\n"
    finally:
        server.stop(linger=0)
