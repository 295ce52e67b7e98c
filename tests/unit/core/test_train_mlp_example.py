"""examples/train_mlp.py as a user runs it: a subprocess that must reach 95% held-out accuracy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_mlp.py"
FINAL = re.compile(r"final held-out accuracy: ([0-9.]+)%")


def _run(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          timeout=100)
    return proc.returncode, proc.stdout, proc.stderr


def test_example_trains_to_the_target_and_prints_progress():
    code, out, err = _run("--epochs", "40", "--seed", "1")
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    accuracy = float(FINAL.search(out).group(1))
    assert accuracy >= 95.0, out
    assert len(re.findall(r"^epoch +\d+ +loss [0-9.]+ +held-out accuracy", out, re.M)) >= 5


def test_example_exits_non_zero_when_the_target_is_missed():
    code, out, err = _run("--epochs", "1", "--seed", "1")
    assert code == 1
    assert float(FINAL.search(out).group(1)) < 95.0
    assert "below 0.95" in err
