"""`shoal run --profile DIR` then `shoal trace merge|summary|plot` on a real two-rank DDP job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.requirements import missing
from tests.support.shoal_run import WORKERS, ShoalRun

WORKER = str(WORKERS / "profiled_ddp.py")


def _trace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.launcher", "trace", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    """Traces of a W=2 DDP job whose rank 1 sleeps 50 ms per step."""
    out = tmp_path_factory.mktemp("profile")
    run = ShoalRun(["--nproc-per-node", "2", "--profile", str(out), WORKER, "--sleep-rank",
                    "1"])
    assert run.wait(90) == 0, run.tail()
    return out


def test_every_rank_writes_its_window_with_a_clock_estimate(profile_dir):
    names = sorted(p.name for p in profile_dir.glob("*.trace.json"))
    assert names == ["rank0.steps3-5.trace.json", "rank1.steps3-5.trace.json"]
    doc = json.loads((profile_dir / names[1]).read_text())
    clock = doc["shoal"]["clock"]
    assert clock["reference_rank"] == 0 and clock["method"].startswith("store round trips")
    # measured 130-180 us on two shared cores; a loaded machine may wake ranks late, so this
    # is only a sanity bound (the shortest of 8 round trips): correctness is the next line
    assert 0 <= clock["error_us"] < 250_000
    # one host: the true offset is 0, so the estimate must be within its own error bound
    assert abs(clock["offset_us"]) <= clock["error_us"] + 1
    colls = [e for e in doc["traceEvents"] if e.get("cat") == "collective"]
    assert colls and all(e["args"]["op"] == "all_reduce" and e["args"]["bytes"] > 0
                         for e in colls)


def test_shoal_run_given_the_directory_in_its_environment_profiles_only_its_ranks(tmp_path):
    # the agent imports core as its workers do; only the workers (they have RANK) profile
    run = ShoalRun(["--nproc-per-node", "2", WORKER, "--steps", "6"],
                   env={"SHOAL_PROFILE_DIR": str(tmp_path)})
    assert run.wait(90) == 0, run.tail()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank0.steps3-5.trace.json", "rank1.steps3-5.trace.json"]
    res = _trace("summary", str(tmp_path))
    assert res.returncode == 0, res.stderr


def test_merge_gives_a_process_per_rank_and_aligned_all_reduces(profile_dir, tmp_path):
    out = tmp_path / "job.json"
    res = _trace("merge", str(profile_dir), "-o", str(out))
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    flows_s = {e["id"] for e in events if e["ph"] == "s"}
    assert flows_s and flows_s == {e["id"] for e in events if e["ph"] == "f"}
    err = doc["shoal"]["clock_error_us"]
    by_seq: dict[int, list] = {}
    for e in events:
        if e.get("cat") == "collective":
            by_seq.setdefault(e["args"]["seq"], []).append((e["ts"], e["ts"] + e["dur"]))
    both = [v for v in by_seq.values() if len(v) == 2]
    for e in events:
        if e.get("cat") == "collective":  # the split of each all_reduce's time
            args = e["args"]
            assert args["wait_for_peers_us"] + args["moving_us"] == pytest.approx(e["dur"],
                                                                                  abs=0.01)
    assert len(both) >= 3
    for (s0, e0), (s1, e1) in both:
        # the same all_reduce on both ranks: the two intervals overlap within the clock error
        assert max(s0, s1) <= min(e0, e1) + 2 * err


def test_summary_names_the_rank_that_sleeps_as_the_straggler(profile_dir):
    res = _trace("summary", str(profile_dir))
    assert res.returncode == 0, res.stderr
    assert "straggler: rank 1 " in res.stdout, res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line[:4].strip().isdigit()]
    assert {(r[0], r[1]) for r in rows} == {(k, s) for k in "01" for s in "345"}
    for r in rows:
        if r[0] == "1":
            assert float(r[7]) >= 45  # the sleep is idle time on rank 1
            assert float(r[8]) < 10  # and it hardly waits for rank 0 in collectives
        else:
            assert float(r[6]) >= 45  # rank 0 waits for it in the all_reduce, exposed
            assert float(r[8]) >= 45  # waiting for a peer, not moving data


def test_plot_draws_the_timelines(profile_dir, tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing("the trace plot test", "matplotlib is not installed (the test extra has it)")
    out = tmp_path / "timeline.png"
    res = _trace("plot", str(profile_dir), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(profile_dir, tmp_path):
    # a matplotlib that cannot be imported shadows the installed one
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(shadow.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = subprocess.run([sys.executable, "-m", "shoal.launcher", "trace", "plot",
                          str(profile_dir), "-o", str(tmp_path / "t.png")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert "shoal trace plot needs matplotlib: pip install matplotlib" in res.stderr
    assert not (tmp_path / "t.png").exists()


def test_merge_refuses_mixed_runs_and_missing_ranks(profile_dir, tmp_path):
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(profile_dir / "rank0.steps3-5.trace.json", lone)
    res = _trace("merge", str(lone), "-o", str(tmp_path / "x.json"))
    assert res.returncode == 2
    assert "Rank 1 is missing from steps 3-5" in res.stderr and "found ranks 0" in res.stderr
    mixed = tmp_path / "mixed"
    shutil.copytree(profile_dir, mixed)
    doc = json.loads((mixed / "rank1.steps3-5.trace.json").read_text())
    doc["shoal"]["run_id"] = "another-run"
    (mixed / "rank1.steps3-5.trace.json").write_text(json.dumps(doc))
    res = _trace("summary", str(mixed))
    assert res.returncode == 2
    assert "come from different runs" in res.stderr and "'another-run'" in res.stderr
