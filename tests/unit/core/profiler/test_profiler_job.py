"""The job profiler SHOAL_PROFILE_DIR starts: windows counted by optimizer steps, in a fresh
interpreter (it starts at import); data-loading events; bad schedule settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shoal import core
from shoal.core import profiler as P
from shoal.core.profiler.job import JobProfile, parse_schedule

SCRIPT = """
from shoal import core
from shoal.core import nn
m = nn.Linear(4, 2)
opt = core.optim.SGD(m.parameters(), lr=0.1)
for _ in range(7):
    m(core.ones(3, 4)).sum().backward()
    opt.step()
"""


def test_the_env_starts_a_job_profiler_that_counts_optimizer_steps(tmp_path):
    env = dict(os.environ, SHOAL_PROFILE_DIR=str(tmp_path), RANK="1", WORLD_SIZE="2",
               SHOAL_PROFILE_SCHEDULE="wait=1,warmup=1,active=2,repeat=2")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # torch's handler's names (<worker>.<span>.pt.trace.json), the span the first step
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank1.00000002.pt.trace.json", "rank1.00000006.pt.trace.json"]
    doc = json.loads((tmp_path / "rank1.00000002.pt.trace.json").read_text())
    assert doc["shoal"]["window"] == [2, 3]
    names = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert names.count("Optimizer.step#SGD.step") == 2
    assert names.count("linear") == 2 and "ProfilerStep#2" in names
    assert doc["shoal"]["clock"] == {"offset_us": 0.0, "error_us": None, "reference_rank": 0,
                                     "method": "none (no process group lent its store)"}
    # the program ended during the second window's last step: stop() saved what it had
    late = json.loads((tmp_path / "rank1.00000006.pt.trace.json").read_text())
    assert [e["name"] for e in late["traceEvents"] if e["ph"] == "X"].count(
        "Optimizer.step#SGD.step") == 1


LENDING = """
from shoal.collectives import profiler_clock
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=10)
profiler_clock.lend_store(pg)
""" + SCRIPT + """
profiler_clock.take_back_store(pg)
pg.shutdown()
"""


def test_the_job_profiler_measures_its_clock_through_the_store_a_group_lent(tmp_path):
    env = dict(os.environ, SHOAL_PROFILE_DIR=str(tmp_path), RANK="0", WORLD_SIZE="1",
               SHOAL_PROFILE_SCHEDULE="wait=1,active=2")
    res = subprocess.run([sys.executable, "-c", LENDING], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "rank0.00000001.pt.trace.json").read_text())
    assert doc["shoal"]["clock"] == {"offset_us": 0.0, "error_us": 0.0, "reference_rank": 0,
                                     "method": "reference"}


def test_a_process_that_is_not_a_rank_does_not_profile(tmp_path):
    # `shoal run` given SHOAL_PROFILE_DIR in its environment imports core as well
    env = dict(os.environ, SHOAL_PROFILE_DIR=str(tmp_path), SHOAL_PROFILE_SCHEDULE="active=2")
    env.pop("RANK", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert list(tmp_path.iterdir()) == []  # with RANK, active=2 would have written 4 windows


def test_bad_schedule_settings_name_the_allowed_ones():
    with pytest.raises(P.ProfilerError, match=r"'every=2' is not a setting; allowed: wait=N, "):
        parse_schedule("every=2")
    with pytest.raises(P.ProfilerError, match=r"active=0 is not allowed"):
        parse_schedule("active=0")


def test_data_loading_waits_are_events():
    from shoal.core.data import DataLoader, TensorDataset

    ds = TensorDataset(core.randn(10, 3))
    with P.profile() as prof:
        batches = list(DataLoader(ds, batch_size=4))
    counts = {a.key: a.count for a in prof.key_averages()}
    assert len(batches) == 3
    # three batches and the call that ends the loop, as torch counts them
    assert counts["enumerate(DataLoader)#_SingleProcessIter.__next__"] == 4


def test_a_users_profiler_records_under_the_job_profiler_and_both_traces_are_whole():
    job = JobProfile(profile_memory=True)  # no schedule: one window from start to stop
    job.start()
    try:
        kept = core.ones(1000)  # 4000 bytes the job's window counts
        with P.profile(profile_memory=True) as user:  # no "already recording" error
            _ = core.ones(10) * 2
            del kept  # freed while the user's window records: still the job's free
        _ = core.ones(3) + 1
        with pytest.raises(P.ProfilerError, match="another profiler is already recording"):
            with P.profile():
                with P.profile():  # two of the user's own at once: refused, as torch does
                    pass
    finally:
        job.stop()
    assert _counts(user) == {"ones": 1, "mul": 1}
    assert _counts(job) == {"ones": 3, "mul": 1, "add": 1}
    frees = [m.mem for m in job.events().recorder.mem_events]
    assert -4000 in frees  # the free of the job's tensor during the user's window
    # the user's allocations reach the job's memory timeline too
    assert sum(fe.ev.mem for fe in job.events() if fe.name == "ones") == 4000 + 40 + 12


def _counts(prof: P.profile) -> dict:
    return {a.key: a.count for a in prof.key_averages()
            if not a.key.startswith(("[", "ProfilerStep#"))}


OVERLAPPING = """
import json, sys
from shoal import core
from shoal.core import nn, profiler
m = nn.Linear(4, 2)
opt = core.optim.SGD(m.parameters(), lr=0.1)
def iteration():
    m(core.ones(3, 4)).sum().backward()
    opt.step()
for _ in range(2):
    iteration()
with profiler.profile() as prof:  # iterations 2-4, across the end of the job's first window
    for _ in range(3):            # and the start of its second
        iteration()
        prof.step()
for _ in range(2):
    iteration()
json.dump({a.key: a.count for a in prof.key_averages()}, sys.stdout)
"""


def test_a_users_profiler_in_a_script_run_with_the_job_profiler_works(tmp_path):
    env = dict(os.environ, SHOAL_PROFILE_DIR=str(tmp_path), RANK="0", WORLD_SIZE="1",
               SHOAL_PROFILE_SCHEDULE="wait=1,active=2,repeat=2")
    res = subprocess.run([sys.executable, "-c", OVERLAPPING], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    user = json.loads(res.stdout)
    assert user["linear"] == 3 and user["Optimizer.step#SGD.step"] == 3
    for window in ("1-2", "4-5"):
        first = int(window.split("-")[0])
        doc = json.loads((tmp_path / f"rank0.{first:08d}.pt.trace.json").read_text())
        names = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
        # each job window has every iteration of its steps, whoever's window recorded them,
        # and only its own step ranges
        assert names.count("linear") == 2, (window, names)
        assert names.count("Optimizer.step#SGD.step") == 2
        first, last = map(int, window.split("-"))
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
            f"ProfilerStep#{first}", f"ProfilerStep#{last}"]
