"""`shoal top` against a running job (rank 1 a deliberate straggler), in a real terminal: tmux
runs it, capture-pane reads the screen, send-keys quits it. Also its text mode and its error
for an endpoint that is not there."""

from __future__ import annotations

import re
import shutil
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


def test_shoal_top_in_tmux_shows_ranks_the_straggler_and_quits_on_q(tmp_path):
    tmux = shutil.which("tmux")
    if tmux is None:
        missing("the terminal view test", "tmux is needed to drive shoal top in a real "
                "terminal (apt-get install tmux)")
    run, stop, port = _start_job(tmp_path, "topjob")
    socket = f"shoal-top-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "exited"
    command = (f"cd {ROOT} && {sys.executable} -m shoal.launcher top 127.0.0.1:{port} "
               f"--interval 0.5; echo $? > {done}")
    t = [tmux, "-L", socket]
    try:
        # An 80x24 terminal, the smallest the view is made for.
        subprocess.run(t + ["-f", "/dev/null", "new-session", "-d", "-x", "80", "-y", "24",
                            "-s", "top", command], check=True, timeout=10)
        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline:
            screen = subprocess.run(t + ["capture-pane", "-p", "-t", "top"], check=True,
                                    capture_output=True, text=True, timeout=10).stdout
            rows = _rows(screen)
            if "<- straggler" in screen and set(rows) == {"0", "1"}:
                break
            time.sleep(0.3)
        job = "run topjob  world 2  running 2  restarts 0/3  failed 0  last restart never"
        assert job in screen, screen
        rows = _rows(screen)
        assert set(rows) == {"0", "1"}, screen
        assert rows["1"].endswith("<- straggler"), screen
        assert "straggler" not in rows["0"], screen
        # Rank 0 waits in collectives most of the time (for rank 1); rank 1 hardly at all.
        wait = {r: int(re.findall(r"(\d+)%", line)[0]) for r, line in rows.items()}
        assert wait["0"] > 50 > wait["1"], screen
        subprocess.run(t + ["send-keys", "-t", "top", "q"], check=True, timeout=10)
        deadline = time.monotonic() + 10
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.exists() and done.read_text().strip() == "0"
    finally:
        subprocess.run(t + ["kill-server"], capture_output=True, timeout=10)
        stop.touch()
        code = run.wait(60)
        run.kill()
    assert code == 0, run.tail()


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
