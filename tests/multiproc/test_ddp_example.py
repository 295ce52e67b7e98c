"""examples/train_ddp.py as users run it: alone, under `shoal run`, and killed mid-run.

A run whose worker is SIGKILLed mid-training is restarted by `shoal run`, resumes from the
latest checkpoint, and must end with exactly the parameters of a run that never stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_ddp.py")
RUN_S = 90.0
FINAL = re.compile(r"final step (\d+) params_sha256 ([0-9a-f]{64})")


def _env(**extra):
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SHOAL_CHECKPOINT_DIR", "SHOAL_RESTART_COUNT"):
        env.pop(name, None)
    env.update(extra)
    return env


def _shoal_run(args, ckpt_dir):
    cmd = [sys.executable, "-m", "shoal.launcher", "run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--checkpoint-dir", str(ckpt_dir), EXAMPLE, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc, timeout=RUN_S):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"the run did not end within {timeout}s; its output:\n{out[-3000:]}")
    return out


def _final(out):
    found = FINAL.findall(out)
    assert len(found) == 1, f"expected one final line, got {found}; output:\n{out[-3000:]}"
    return int(found[0][0]), found[0][1]


def test_runs_without_a_launcher_as_a_group_of_one(tmp_path):
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--steps", "3", "--checkpoint-dir", str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^step 3 loss \d+\.\d{4}$", proc.stdout, re.M), proc.stdout
    assert _final(proc.stdout)[0] == 3


def _worker_pids(agent_pid):
    out = subprocess.run(["pgrep", "-P", str(agent_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_a_killed_worker_resumes_from_the_checkpoint_with_identical_parameters(tmp_path):
    args = ["--steps", "10", "--checkpoint-every", "2", "--seed", "3"]
    clean = _shoal_run(args, tmp_path / "clean")
    steps, clean_hash = _final(_finish(clean))
    assert steps == 10

    faulty = _shoal_run(args + ["--step-sleep", "0.15"], tmp_path / "faulty")
    lines = []
    deadline = time.monotonic() + RUN_S
    for line in faulty.stdout:  # read until rank 0 reports step 5, then kill a worker
        lines.append(line)
        if "step 5 loss" in line:
            break
        assert time.monotonic() < deadline, "the run never reached step 5:\n" + "".join(lines)
    workers = _worker_pids(faulty.pid)
    assert workers, "shoal run has no worker processes to kill"
    os.kill(workers[-1], signal.SIGKILL)
    out = "".join(lines) + _finish(faulty)
    assert faulty.returncode == 0, out[-3000:]
    assert re.search(r"resumed from step [46] \(restart 1\)", out), out[-3000:]
    assert _final(out) == (10, clean_hash)
