"""Checkpointer states exported to and imported from authenticated safetensors files."""

import numpy as np
import pytest

from shoal import core
from shoal.elastic.checkpoint import Checkpointer, CheckpointUnauthenticated
from shoal.elastic.checkpoint_format import CheckpointCorrupt
from shoal.elastic.checkpoint_safetensors import (
    export_safetensors,
    import_safetensors,
    load_safetensors,
    save_safetensors,
)

TOKEN = "job-secret-one"


def _state():
    model = core.nn.Linear(4, 3)
    return {"model": model.state_dict(), "epoch": 2, "rng": np.arange(3, dtype=np.uint8)}


def test_export_then_import_round_trips_a_checkpoint(tmp_path):
    ckpt = Checkpointer(tmp_path / "a", token=TOKEN)
    state = _state()
    ckpt.save(7, state)
    out = export_safetensors(ckpt, 7, tmp_path / "s.safetensors", token=TOKEN)
    other = Checkpointer(tmp_path / "b", token=TOKEN)
    import_safetensors(other, out, token=TOKEN)
    step, loaded = other.load_latest()
    assert step == 7 and loaded["epoch"] == 2
    assert np.array_equal(loaded["rng"], state["rng"])
    assert core.equal(loaded["model"]["weight"], state["model"]["weight"])


def test_another_jobs_file_and_a_changed_one_are_refused(tmp_path):
    path = save_safetensors(tmp_path / "s.safetensors", _state(), 3, token=TOKEN)
    with pytest.raises(CheckpointUnauthenticated, match="another job"):
        load_safetensors(path, token="someone-else")
    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 1  # the last byte of the last tensor
    open(path, "wb").write(bytes(blob))
    with pytest.raises(CheckpointUnauthenticated, match="changed since"):
        load_safetensors(path, token=TOKEN)


def test_a_state_with_an_object_cannot_be_exported_and_garbage_is_corrupt(tmp_path):
    from shoal.elastic.api import CheckpointError

    with pytest.raises(CheckpointError, match="cannot save an object of type"):
        save_safetensors(tmp_path / "x.safetensors", {"f": open}, token=TOKEN)
    (tmp_path / "g.safetensors").write_bytes(b"\x05" + b"\0" * 7 + b"{not json")
    with pytest.raises(CheckpointCorrupt, match="not a readable safetensors file"):
        load_safetensors(tmp_path / "g.safetensors", token=TOKEN)
