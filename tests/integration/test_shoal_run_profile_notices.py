"""What `shoal run --profile DIR` says: where the traces go, and why none came from a job that
stepped no shoal optimizer; `shoal trace plot -o` to a path that cannot be written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support.requirements import missing
from tests.support.shoal_run import ROOT, WORKERS, ShoalRun

NO_TRACE = "no rank wrote a trace"


def test_a_shoal_job_writes_traces_and_says_where(tmp_path):
    out = tmp_path / "traces"
    with ShoalRun(["--nproc-per-node", "2", "--max-restarts", "0", "--profile", str(out),
                   str(WORKERS / "profiled_ddp.py")], name="profiled") as run:
        assert run.wait(90) == 0, run.tail()
    assert f"to {out}; read them with `shoal trace summary {out}`" in run.output, run.tail()
    assert NO_TRACE not in run.output
    assert len(list(out.iterdir())) >= 2
    if importlib.util.find_spec("matplotlib") is None:
        return
    bad = tmp_path / "no-such-dir" / "timeline.png"
    done = subprocess.run([sys.executable, "-m", "shoal.launcher", "trace", "plot", str(out),
                           "-o", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"shoal trace plot: cannot use {str(bad)!r}: No such file or directory" in done.stderr


def test_a_torch_job_with_profile_says_once_why_nothing_was_written(tmp_path):
    if importlib.util.find_spec("torch") is None:
        missing("the torch-script tests", "torch is not installed (pip install torch==2.13.0)")
    out = tmp_path / "traces"
    with ShoalRun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--profile",
                   str(out), str(ROOT / "examples" / "torch" / "ddp.py"), "--steps", "2"],
                  name="torch profiled") as run:
        assert run.wait(120) == 0, run.tail()
    assert run.output.count(NO_TRACE) == 1, run.tail()
    assert "stepped none" in run.output and "torch.profiler" in run.output


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("SHOAL_PROFILE_DIR", raising=False)
