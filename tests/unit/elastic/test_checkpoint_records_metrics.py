"""elastic's Checkpointer records its own saves and loads (no wrapper needed): duration, bytes,
the last checkpointed step and its time, so "checkpoint too old" and the work a failure would
throw away show for every job that checkpoints."""

from __future__ import annotations

import os
import time

import numpy as np

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
