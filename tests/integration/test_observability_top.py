"""`shoal top` against a running job (rank 1 a deliberate straggler), in a real terminal: tmux
runs it, capture-pane reads the screen, send-keys quits it. The screen follows the job live:
the steps advance, and a killed worker shows as restarts 1/3 and failed 1 while the job
recovers. Also its text mode and its error for an endpoint that is not there."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

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
