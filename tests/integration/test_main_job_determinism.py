"""The main job (examples/train_gpt.py, tiny, dropout 0.1, --deterministic) is bitwise
repeatable: two runs with the same seed end with the same parameter digest at W=1 and at W=2
under `shoal run`, and so does a W=2 run one of whose workers is SIGKILLed after a checkpoint,
restarted by `shoal run --max-restarts 1` and resumed from that checkpoint (model, optimizer,
scheduler, loader position and core's random state, which dropout draws from)."""

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
GPT = str(ROOT / "examples" / "train_gpt.py")
DIGEST = re.compile(r"params_sha256 ([0-9a-f]{64})")
TINY = ["--steps", "4", "--context", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--batch-size", "4", "--eval-windows", "8", "--log-every", "2", "--sample-chars", "5",
        "--checkpoint-every", "2", "--dropout", "0.1", "--deterministic"]
RUN_S = 120

pytestmark = pytest.mark.timeout(300)


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SHOAL_CHECKPOINT_DIR", "SHOAL_RESTART_COUNT")}
    env["TMPDIR"] = str(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _command(tmp_path, world, ckpt, *extra):
    launcher = ([sys.executable, "-m", "shoal.launcher", "run", "--nproc-per-node", str(world),
                 "--max-restarts", "1"] if world > 1 else [sys.executable])
    return [*launcher, GPT, *TINY, "--checkpoint-dir", str(tmp_path / ckpt), *extra]


def _run(tmp_path, world, ckpt, *extra):
    proc = subprocess.run(_command(tmp_path, world, ckpt, *extra), cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=RUN_S)
    return proc.returncode, proc.stdout + proc.stderr


def _digest(out):
    found = DIGEST.findall(out)
    assert len(found) == 1, f"expected one final digest, got {found}:\n{out[-3000:]}"
    return found[0]


@pytest.mark.parametrize("world", [1, 2])
def test_two_runs_with_the_same_seed_end_with_the_same_parameters(tmp_path, world):
    code, first = _run(tmp_path, world, "a")
    assert code == 0, first[-3000:]
    assert "dropout 0.1, deterministic algorithms on" in first, first[-3000:]
    code, second = _run(tmp_path, world, "b")
    assert code == 0, second[-3000:]
    assert _digest(first) == _digest(second)
    code, other = _run(tmp_path, world, "c", "--seed", "1")
    assert code == 0 and _digest(other) != _digest(first)  # the digest does tell runs apart


def test_dropout_draws_masks_so_the_digest_depends_on_it(tmp_path):
    # Without this, the repeatability above could hold only because dropout never drew.
    code, with_dropout = _run(tmp_path, 1, "a")
    assert code == 0, with_dropout[-3000:]
    code, without = _run(tmp_path, 1, "b", "--dropout", "0")
    assert code == 0, without[-3000:]
    assert _digest(without) != _digest(with_dropout)


def _worker_pids(launcher_pid):
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True,
                         timeout=10)
    return [int(pid) for pid in out.stdout.split()]


def _wait_for(path, proc, deadline):
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path.name} was written"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def test_w2_run_with_a_worker_killed_after_a_checkpoint_ends_like_an_unbroken_one(tmp_path):
    steps = ["--steps", "12"]
    code, unbroken = _run(tmp_path, 2, "fresh", *steps)
    assert code == 0, unbroken[-3000:]

    # Each step sleeps 0.3 s, so the run is still training when step 4's checkpoint lands.
    ckpt = tmp_path / "killed"
    proc = subprocess.Popen(_command(tmp_path, 2, "killed", *steps, "--step-sleep", "0.3"),
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(ckpt / "ckpt-000000000004.shoal", proc, time.monotonic() + RUN_S)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 2, f"expected 2 workers under shoal run, found {workers}"
        os.kill(workers[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert proc.returncode == 0, out[-3000:]
    resumed = re.findall(r"resumed from step (\d+)", out)
    # Killed after step 4's checkpoint: the restart resumes from step 4 or, if the kill landed
    # a step later, from the checkpoint after it, never from scratch.
    assert len(resumed) == 1 and 4 <= int(resumed[0]) < 12, out[-3000:]
    assert _digest(out) == _digest(unbroken)
