"""Checkpointer: round trips, keep-k, corruption detection and fallback, a save killed midway."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal import core
from shoal.core import nn
from shoal.elastic.api import CheckpointError
from shoal.elastic.checkpoint import Checkpointer, CheckpointCorrupt

WAIT_S = 60.0


def training_state(seed: int = 0) -> dict:
    """Model, optimizer, scheduler-like and RNG states as a training loop would save them."""
    core.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = core.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(core.Tensor(np.ones((2, 4), dtype=np.float32))).sum().backward()
    opt.step()
    rng = np.random.default_rng(seed)
    return {
        "model": {k: v.array.copy() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": {"last_epoch": 3, "base_lrs": [0.1]},
        "step": 42,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                "generator": rng.bit_generator.state},
        "strided": np.arange(20, dtype=np.int64)[::3],
        "bf16": np.linspace(0, 1, 5).astype(ml_dtypes.bfloat16),
        "scalar": np.float32(2.5),
    }


def assert_same(a, b):
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray) or hasattr(a, "array") and isinstance(a.array, np.ndarray):
        x = a if isinstance(a, np.ndarray) else a.array
        y = b if isinstance(b, np.ndarray) else b.array
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    else:
        assert a == b


def test_round_trip_of_a_training_state(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    state = training_state()
    path = ck.save(42, state)
    assert os.path.basename(path) == "ckpt-000000000042.shoal"
    step, loaded = ck.load_latest()
    assert step == 42
    assert_same(state, loaded)
    assert loaded["strided"].flags.writeable
    # the RNG states really restore the streams
    g = np.random.default_rng()
    g.bit_generator.state = loaded["rng"]["generator"]
    assert g.random() == np.random.default_rng(0).random()


def test_keeps_the_newest_k_and_reports_steps(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    assert ck.latest_step() is None and ck.load_latest() is None
    for step in (5, 10, 15, 20):
        ck.save(step, {"step": step})
    assert ck.steps() == [15, 20] and ck.latest_step() == 20
    assert ck.load(15) == {"step": 15}
    with pytest.raises(CheckpointError, match=r"There is no checkpoint of step 5 "):
        ck.load(5)


def _damage_and_load(tmp_path, damage, caplog):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"w": np.arange(1000.0), "step": 1})
    ck.save(2, {"w": np.arange(1000.0) * 2, "step": 2})
    with open(ck.path(2), "r+b") as f:
        damage(f, os.path.getsize(ck.path(2)))
    with caplog.at_level(logging.WARNING, logger="shoal.elastic.checkpoint"):
        step, state = ck.load_latest()
    assert step == 1 and state["step"] == 1
    np.testing.assert_array_equal(state["w"], np.arange(1000.0))
    (record,) = [r for r in caplog.records if "Skipping checkpoint of step 2" in r.getMessage()]
    return record.getMessage()


def test_a_truncated_file_falls_back_to_the_one_before(tmp_path, caplog):
    message = _damage_and_load(tmp_path, lambda f, size: f.truncate(size // 2), caplog)
    assert "has no end marker: it is truncated" in message


def test_flipped_bytes_fail_the_checksum_and_fall_back(tmp_path, caplog):
    def flip(f, size):
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))

    message = _damage_and_load(tmp_path, flip, caplog)
    assert "fails its sha256 check" in message


def test_when_no_checkpoint_verifies_loading_fails_loudly(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(3, {"step": 3})
    with open(ck.path(3), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match=r"None of the 1 checkpoints in .* is readable: "
                                              r"Checkpoint .*ckpt-000000000003.shoal' is truncated"):
        ck.load_latest()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.floats(0, 1, exclude_max=True), xor=st.integers(1, 255))
def test_any_single_byte_flip_is_detected_or_harmless(tmp_path, position, xor):
    ck = Checkpointer(tmp_path / f"f{random.getrandbits(32)}")
    state = {"w": np.arange(64, dtype=np.float32), "meta": {"lr": 0.1, "name": "x"}}
    ck.save(7, state)
    path = ck.path(7)
    size = os.path.getsize(path)
    at = int(position * size)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ xor]))
    try:
        loaded = ck.load(7)
    except CheckpointCorrupt:
        return
    assert_same(state, loaded)  # only a flip that changes nothing (JSON whitespace) may load


def test_unsafe_objects_are_refused_unless_trusted(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"call": os.getpid})
    with pytest.raises(CheckpointError, match=r"holds posix\.getpid, which is not on the list"):
        ck.load_latest()
    assert Checkpointer(tmp_path, trusted=True).load(1)["call"] is os.getpid
    assert Checkpointer(tmp_path, allow=["posix.getpid"]).load(1)["call"] is os.getpid


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"keep must be an integer >= 1, got 0"):
        Checkpointer(tmp_path, keep=0)
    ck = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=r"step must be an integer in 0\.\.10\*\*12-1, got -1"):
        ck.save(-1, {})
    with pytest.raises(ValueError, match=r"state must be a dict, got list"):
        ck.save(1, [])
    with pytest.raises(CheckpointError, match=r"The state of step 1 cannot be pickled"):
        ck.save(1, {"lock": __import__("threading").Lock()})
    assert ck.steps() == [] and os.listdir(tmp_path) == []


class Stall:
    """Pickling this announces itself through a file and then hangs, mid-save."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        with open(self.marker, "w") as f:
            f.write("pickling")
        time.sleep(WAIT_S)
        return (str, ("never",))


def _save_then_stall(directory: str, marker: str) -> None:
    ck = Checkpointer(directory)
    ck.save(1, {"w": np.ones(100_000), "step": 1})
    ck.save(2, {"w": np.full(100_000, 2.0), "stall": Stall(marker), "step": 2})


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    directory, marker = str(tmp_path / "ck"), str(tmp_path / "marker")
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_save_then_stall, args=(directory, marker))
    child.start()
    try:
        end = time.monotonic() + WAIT_S
        while not os.path.exists(marker) and child.is_alive() and time.monotonic() < end:
            time.sleep(0.01)
        assert os.path.exists(marker), f"the child never reached step 2 (exit {child.exitcode})"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
    leftovers = [n for n in os.listdir(directory) if n.endswith(".tmp")]
    assert len(leftovers) == 1, os.listdir(directory)
    ck = Checkpointer(directory)
    assert ck.steps() == [1]
    step, state = ck.load_latest()
    assert step == 1 and state["step"] == 1
    np.testing.assert_array_equal(state["w"], np.ones(100_000))
    # the next save cleans up the killed save's temporary file
    ck.save(3, {"step": 3})
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
