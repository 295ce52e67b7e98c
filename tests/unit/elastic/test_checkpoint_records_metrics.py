"""elastic's Checkpointer records its own saves and loads (no wrapper needed): duration, bytes,
the last checkpointed step and its time, so "checkpoint too old" and the work a failure would
throw away show for every job that checkpoints. shoal.metrics' wrappers record a checkpointer
of the user's own the same way, and after a fall back to an older checkpoint the last
checkpointed step is the one loaded, across worker processes as under `shoal run`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, multiprocess

from shoal.elastic import training_metrics as tm
from shoal.elastic.checkpoint import Checkpointer


def _value(metric, **labels):
    return (metric.labels(**labels) if labels else metric)._value.get()


def test_checkpointer_save_and_load_feed_the_checkpoint_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_AUTH_TOKEN", "checkpoint-metrics-" + "x" * 16)
    ck = Checkpointer(str(tmp_path), keep=2)
    saved_before = _value(tm.CHECKPOINT_BYTES, operation="save")
    loaded_before = _value(tm.CHECKPOINT_BYTES, operation="load")
    t0 = time.time()
    path = ck.save(7, {"w": np.arange(1000, dtype=np.float32)})
    size = os.path.getsize(path)
    assert _value(tm.CHECKPOINT_BYTES, operation="save") - saved_before == size
    assert _value(tm.CHECKPOINT_STEP) == 7
    assert _value(tm.CHECKPOINT_TIME) >= t0
    step, state = ck.load_latest()
    assert step == 7 and np.array_equal(state["w"], np.arange(1000, dtype=np.float32))
    assert _value(tm.CHECKPOINT_BYTES, operation="load") - loaded_before == size
    # The wrappers of shoal.metrics do not count elastic's saves twice.
    tm.save_checkpoint(ck, 8, {"w": np.zeros(3)})
    assert _value(tm.CHECKPOINT_BYTES, operation="save") - saved_before == (
        size + os.path.getsize(ck.path(8)))


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, labels) or 0.0


class NpzCheckpointer:
    """A checkpointer of a user's own, not shoal's: one .npz file per step; load_latest skips
    a damaged file and falls back to the one before, as many do."""

    def __init__(self, directory):
        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:08d}.npz")

    def save(self, step: int, state: dict) -> str:
        np.savez(self.path(step), **state)
        return self.path(step)

    def load_latest(self):
        steps = sorted((int(n[5:13]) for n in os.listdir(self.directory) if n.endswith(".npz")),
                       reverse=True)
        for step in steps:
            try:
                with np.load(self.path(step)) as f:
                    return step, {k: f[k] for k in f.files}
            except (OSError, ValueError, zipfile.BadZipFile):
                continue
        return None


def test_the_wrappers_record_a_checkpointer_of_your_own(tmp_path):
    ck = NpzCheckpointer(tmp_path)
    count = _sample("shoal_checkpoint_duration_seconds_count", operation="save")
    took = _sample("shoal_checkpoint_duration_seconds_sum", operation="save")
    saved = _sample("shoal_checkpoint_bytes_total", operation="save")
    t0 = time.time()
    path = tm.save_checkpoint(ck, 12, {"w": np.arange(1000.0)})
    t1 = time.time()
    assert path == ck.path(12)
    assert _sample("shoal_checkpoint_duration_seconds_count", operation="save") == count + 1
    save_seconds = _sample("shoal_checkpoint_duration_seconds_sum", operation="save") - took
    assert 0 < save_seconds <= t1 - t0
    assert _value(tm.CHECKPOINT_LAST_SECONDS, operation="save") == pytest.approx(save_seconds)
    assert _sample("shoal_checkpoint_bytes_total", operation="save") - saved == \
        os.path.getsize(path)
    assert _value(tm.CHECKPOINT_STEP) == 12
    assert t0 <= _value(tm.CHECKPOINT_TIME) <= t1

    # A newer checkpoint, then damaged: loading falls back to step 12, and step 12 (saved
    # when its file was written) is the last checkpointed step again, not 13.
    newer = tm.save_checkpoint(ck, 13, {"w": np.ones(1000)})
    assert _value(tm.CHECKPOINT_STEP) == 13
    with open(newer, "r+b") as f:
        f.truncate(100)
    count = _sample("shoal_checkpoint_duration_seconds_count", operation="load")
    loaded = _sample("shoal_checkpoint_bytes_total", operation="load")
    step, state = tm.load_latest_checkpoint(ck)
    assert step == 12 and np.array_equal(state["w"], np.arange(1000.0))
    assert _sample("shoal_checkpoint_duration_seconds_count", operation="load") == count + 1
    assert _sample("shoal_checkpoint_bytes_total", operation="load") - loaded == \
        os.path.getsize(path)
    assert _value(tm.CHECKPOINT_LAST_SECONDS, operation="load") > 0
    assert _value(tm.CHECKPOINT_STEP) == 12
    assert _value(tm.CHECKPOINT_TIME) == os.path.getmtime(path)

    # Nothing to load: None, and no load recorded.
    assert tm.load_latest_checkpoint(NpzCheckpointer(tmp_path / "empty")) is None
    assert _sample("shoal_checkpoint_duration_seconds_count", operation="load") == count + 1


def test_load_latest_checkpoint_refuses_a_checkpointer_without_path():
    class OnlyLoads:
        def load_latest(self):
            return None

    with pytest.raises(TypeError, match=r"^load_latest_checkpoint needs a checkpointer with "
                                        r"load_latest\(\) and path\(step\); OnlyLoads has no "
                                        r"path\(\)\.$"):
        tm.load_latest_checkpoint(OnlyLoads())


_SAVE_TWO = (
    "import sys\n"
    "import numpy as np\n"
    "from shoal.elastic.checkpoint import Checkpointer\n"
    "ck = Checkpointer(sys.argv[1])\n"
    "for step in (10, 20):\n"
    "    ck.save(step, {'w': np.full(100, float(step))})\n"
)
_RESUME = {
    "through shoal.metrics": (
        "import sys\n"
        "import shoal.metrics as sm\n"
        "from shoal.elastic.checkpoint import Checkpointer\n"
        "print(sm.load_latest_checkpoint(Checkpointer(sys.argv[1]))[0])\n"),
    "Checkpointer.load_latest": (
        "import sys\n"
        "from shoal.elastic.checkpoint import Checkpointer\n"
        "print(Checkpointer(sys.argv[1]).load_latest()[0])\n"),
}


@pytest.mark.parametrize("how", sorted(_RESUME))
def test_a_restarted_worker_that_falls_back_reports_the_older_step(tmp_path, how):
    # As under shoal run: one worker process saves steps 10 and 20 and ends; step 20's file is
    # damaged; the restarted worker falls back to step 10. The agent serves both processes'
    # files: the last checkpointed step is 10, saved when step 10's file was.
    multiproc, ckpt = tmp_path / "mp", tmp_path / "ckpt"
    multiproc.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc), "RANK": "0",
           "SHOAL_AUTH_TOKEN": "fallback-metrics-" + "x" * 16}
    subprocess.run([sys.executable, "-c", _SAVE_TWO, str(ckpt)], env=env, check=True,
                   timeout=60)
    ck = Checkpointer(str(ckpt))
    with open(ck.path(20), "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\0" * 10)
    resumed = subprocess.run([sys.executable, "-c", _RESUME[how], str(ckpt)], env=env, check=True,
                             capture_output=True, text=True, timeout=60)
    assert resumed.stdout.strip() == "10", resumed.stderr

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(multiproc))
    assert registry.get_sample_value("shoal_checkpoint_last_step") == 10
    assert registry.get_sample_value("shoal_checkpoint_last_save_timestamp_seconds") == \
        os.path.getmtime(ck.path(10))
    # Both saves and the one successful load (step 20's refused read is not a load) counted.
    assert registry.get_sample_value("shoal_checkpoint_duration_seconds_count",
                                     {"operation": "save"}) == 2
    assert registry.get_sample_value("shoal_checkpoint_duration_seconds_count",
                                     {"operation": "load"}) == 1
