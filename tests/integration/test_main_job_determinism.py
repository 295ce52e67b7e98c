"""The main job (examples/train_gpt.py, tiny) is bitwise repeatable: two runs with the same seed
end with the same parameter digest at W=1 and at W=2 under `shoal run`, and so does a W=2 run
that is stopped after step 3 and resumed from its step-2 checkpoint by a second launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "train_gpt.py")
DIGEST = re.compile(r"params_sha256 ([0-9a-f]{64})")
TINY = ["--steps", "4", "--context", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--batch-size", "4", "--eval-windows", "8", "--log-every", "2", "--sample-chars", "5",
        "--checkpoint-every", "2"]

pytestmark = pytest.mark.timeout(300)


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SHOAL_CHECKPOINT_DIR", "SHOAL_RESTART_COUNT")}
    env["TMPDIR"] = str(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(tmp_path, world, ckpt, *extra):
    launcher = ([sys.executable, "-m", "shoal.launcher", "run", "--nproc-per-node", str(world)]
                if world > 1 else [sys.executable])
    proc = subprocess.run([*launcher, GPT, *TINY, "--checkpoint-dir", str(tmp_path / ckpt), *extra],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def _digest(out):
    found = DIGEST.search(out)
    assert found, out[-3000:]
    return found.group(1)


@pytest.mark.parametrize("world", [1, 2])
def test_two_runs_with_the_same_seed_end_with_the_same_parameters(tmp_path, world):
    code, first = _run(tmp_path, world, "a")
    assert code == 0, first[-3000:]
    code, second = _run(tmp_path, world, "b")
    assert code == 0, second[-3000:]
    assert _digest(first) == _digest(second)
    code, other = _run(tmp_path, world, "c", "--seed", "1")
    assert code == 0 and _digest(other) != _digest(first)  # the digest does tell runs apart


def test_w2_run_stopped_and_resumed_ends_like_an_unbroken_one(tmp_path):
    # Stopped after step 3, not 2: step 3's all-reduce cannot finish before rank 0 has written
    # step 2's checkpoint, whereas a rank stopping right after step 2 may get rank 0 killed
    # while it writes (then the resume would start from scratch and test nothing).
    code, stopped = _run(tmp_path, 2, "k", "--stop-after", "3")
    assert code != 0 and "params_sha256" not in stopped, stopped[-3000:]  # it did not finish
    code, resumed = _run(tmp_path, 2, "k")
    assert code == 0 and "resumed from step 2" in resumed, resumed[-3000:]
    code, unbroken = _run(tmp_path, 2, "fresh")
    assert code == 0, unbroken[-3000:]
    assert _digest(resumed) == _digest(unbroken)
