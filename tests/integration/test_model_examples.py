"""The model examples as users run them: the README's main job (the GPT, slow), the GPT's
checkpoint/resume, its loss-curve PNG (and the one-line note without matplotlib), and the
digits convnet under `shoal run` with DDP and SyncBatchNorm."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.requirements import missing

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "train_gpt.py")
CONVNET = str(ROOT / "examples" / "train_convnet.py")
FINAL_GPT = re.compile(
    r"final held-out ([0-9.]+) bits/char = ([0-9.]+) x unigram entropy \(([0-9.]+)\) after (\d+) "
    r"steps in \d+ s; params_sha256 ([0-9a-f]{64})"
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NO_PLOT_NOTE = "no loss plot: matplotlib is not installed (pip install 'shoal[models]')"
TINY = ["--steps", "4", "--context", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--batch-size", "4", "--eval-windows", "8", "--log-every", "2", "--sample-chars", "5",
        "--checkpoint-every", "2"]


def _env(tmp_path, **extra):
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SHOAL_CHECKPOINT_DIR", "SHOAL_RESTART_COUNT"):
        env.pop(name, None)
    env["TMPDIR"] = str(tmp_path)  # the loss PNG's default home
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _gpt(tmp_path, *args, timeout=120, env=None):
    proc = subprocess.run([sys.executable, GPT, *TINY, *args], cwd=ROOT,
                          env=env or _env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing("the loss-plot checks", "matplotlib is not installed (the test extra has it)")


def test_gpt_resumed_from_a_checkpoint_ends_like_an_unbroken_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    dropout = ("--dropout", "0.1")  # the resume must continue dropout's random stream too
    code, out = _gpt(tmp_path, *dropout, "--checkpoint-dir", str(ckpt), "--stop-after", "2")
    assert code == 3 and "stopping after step 2" in out, out[-2000:]
    code, resumed = _gpt(tmp_path, *dropout, "--checkpoint-dir", str(ckpt))
    assert code == 0 and "resumed from step 2" in resumed, resumed[-2000:]
    code, unbroken = _gpt(tmp_path, *dropout, "--checkpoint-dir", str(tmp_path / "fresh"))
    assert code == 0, unbroken[-2000:]
    assert FINAL_GPT.search(resumed).group(5) == FINAL_GPT.search(unbroken).group(5)
    assert re.search(r"step 4/4 \| \d+ samples/s \| train loss [0-9.]+ \| held-out [0-9.]+ bits/char",
                     unbroken)
    assert "sample: 'The " in unbroken


def test_gpt_without_matplotlib_says_so_in_one_line_and_succeeds(tmp_path):
    # A matplotlib that cannot be imported, first on the path, hides the installed one.
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(shadow.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    plot = tmp_path / "loss.png"
    code, out = _gpt(tmp_path, "--plot", str(plot), env=env)
    assert code == 0, out[-2000:]
    assert [line for line in out.splitlines() if "loss plot" in line] == [NO_PLOT_NOTE]
    assert "Traceback" not in out and FINAL_GPT.search(out), out[-2000:]
    assert not plot.exists()


def test_gpt_writes_its_loss_curve_as_a_png(tmp_path):
    _require_matplotlib()
    plot = tmp_path / "loss.png"
    code, out = _gpt(tmp_path, "--plot", str(plot))
    assert code == 0, out[-2000:]
    assert f"loss curve written to {plot}" in out
    assert plot.read_bytes()[:8] == PNG_SIGNATURE


def _readme_main_job() -> str:
    """The job part (after the installs) of the quick start's first command, as written."""
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start"):]
    block = quick[quick.index("```") + 3:]
    command = block[: block.index("```")].strip()
    assert "\n" not in command, "the main-job command must stay one line"
    return command.split("&&")[-1].strip()


@pytest.mark.slow
@pytest.mark.timeout(300)  # the bound under test is 180 s; the suite's default is 120 s
def test_readme_main_job_reaches_the_held_out_bar_within_three_minutes(tmp_path):
    _require_matplotlib()
    job = _readme_main_job()
    assert job == "shoal run --nproc-per-node 2 examples/train_gpt.py", job
    started = time.monotonic()
    proc = subprocess.run(shlex.split(job), cwd=ROOT, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=240)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    found = FINAL_GPT.search(out)
    assert found, out[-3000:]
    bits, unigram = float(found.group(1)), float(found.group(3))
    assert bits <= 0.7 * unigram, f"held-out {bits} bits/char is above 0.7 x {unigram}"
    assert elapsed <= 180, f"the main job took {elapsed:.0f} s (over 3 minutes)"
    assert "sample: 'The " in out
    plot = tmp_path / "shoal_gpt_loss.png"  # the default, under TMPDIR
    assert f"loss curve written to {plot}" in out, out[-3000:]
    assert plot.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_convnet_with_ddp_and_sync_batchnorm_reaches_97_percent(tmp_path):
    pytest.importorskip("sklearn")
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.launcher", "run", "--nproc-per-node", "2", CONVNET],
        cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    found = re.search(r"final held-out accuracy ([0-9.]+) after (\d+) epochs", out)
    assert found, out[-3000:]
    assert float(found.group(1)) >= 0.97, out[-3000:]
