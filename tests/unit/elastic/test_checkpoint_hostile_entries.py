"""Checkpoint loading and saving against what else may sit in the directory under a checkpoint's
name: a FIFO (an open() that never returns), a symbolic link, a huge sparse file with a valid
magic (an allocation that fails), a directory. Loading rejects each without blocking, names it,
and falls back to the checkpoint before; saving moves what is in the way aside and says so."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from shoal.elastic.checkpoint import Checkpointer
from shoal.elastic.checkpoint_format import END, MAGIC

TOKEN = "hostile-entries-secret"
WAIT_S = 10.0
LOGGER = "shoal.elastic.checkpoint"


def _two_good(tmp_path) -> Checkpointer:
    ck = Checkpointer(tmp_path / "ck", token=TOKEN)
    ck.save(1, {"w": np.arange(4.0)})
    ck.save(2, {"w": np.arange(4.0) + 1})
    return ck


def _load_latest_within(ck: Checkpointer, timeout: float):
    """load_latest in a daemon thread: (finished, result or exception)."""
    box: dict = {}

    def run():
        try:
            box["result"] = ck.load_latest()
        except BaseException as exc:  # noqa: BLE001  (handed to the test, which asserts on it)
            box["result"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), box.get("result")


def test_a_fifo_under_the_newest_name_is_skipped_without_blocking(tmp_path, caplog):
    ck = _two_good(tmp_path)
    fifo = ck.path(3)
    os.mkfifo(fifo)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            finished, result = _load_latest_within(ck, WAIT_S)
    finally:
        # Unblock a reader stuck in open() (the bug), so the thread can end.
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert finished, "load_latest blocked in open() on a FIFO"
    step, state = result
    assert step == 2 and state["w"][0] == 1.0
    assert any("Skipping checkpoint of step 3" in r.getMessage() and fifo in r.getMessage()
               and "FIFO" in r.getMessage() for r in caplog.records), caplog.text


def test_a_symlink_under_a_checkpoint_name_is_refused(tmp_path, caplog):
    ck = _two_good(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 100)
    os.symlink(target, ck.path(3))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step, _ = ck.load_latest()
    assert step == 2
    assert "symbolic link" in caplog.text


def _sparse_with_valid_framing(path: str, size: int, header: bytes) -> None:
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.truncate(size)
        f.seek(size - len(END))
        f.write(END)


def test_a_sparse_file_with_a_junk_header_is_refused_before_any_allocation(tmp_path, caplog):
    ck = _two_good(tmp_path)
    # 30 GB of nothing but the magic and the end marker: refused on its header alone, at once.
    _sparse_with_valid_framing(ck.path(3), 30 << 30, b"")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        finished, result = _load_latest_within(ck, WAIT_S)
    assert finished
    assert result[0] == 2, result
    assert "Skipping checkpoint of step 3" in caplog.text


def test_a_header_that_disagrees_with_the_file_size_is_refused(tmp_path, caplog):
    ck = _two_good(tmp_path)
    header = json.dumps({"format": 2, "step": 3, "payload_bytes": 10,
                         "skeleton": {"offset": 0, "nbytes": 1}, "arrays": []}).encode()
    _sparse_with_valid_framing(ck.path(3), 1 << 30, header)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ck.load_latest()[0] == 2
    assert "bad payload length: 10" in caplog.text and "Skipping checkpoint of step 3" in caplog.text


def test_a_consistent_header_too_big_to_allocate_is_treated_as_corrupt(tmp_path):
    """The issue's 30 GB sparse file, its header consistent with its size: under an address-
    space limit the buffer cannot be had, and that is a corrupt checkpoint, not a crash."""
    ck = _two_good(tmp_path)
    size = 30 << 30
    header = b"{}"
    for _ in range(3):  # the header's own length enters the payload's
        header = json.dumps({"format": 2, "step": 3, "payload_bytes": size - 56 - len(header),
                             "skeleton": {"offset": 0, "nbytes": 1}, "arrays": []}).encode()
    _sparse_with_valid_framing(ck.path(3), size, header)
    script = textwrap.dedent(f"""
        import logging, resource, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        from shoal.elastic.checkpoint import Checkpointer
        ck = Checkpointer({str(tmp_path / "ck")!r}, token={TOKEN!r})
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        print("loaded step", ck.load_latest()[0])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loaded step 2" in done.stdout
    assert "Skipping checkpoint of step 3" in done.stdout and "memory" in done.stdout


def test_a_directory_under_the_next_name_is_moved_aside_and_the_save_succeeds(tmp_path, caplog):
    ck = _two_good(tmp_path)
    blocker = ck.path(3)
    os.mkdir(blocker)
    (tmp_path / "ck" / os.path.basename(blocker) / "notes.txt").write_text("the user's")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ck.save(3, {"w": np.zeros(2)}) == blocker
        ck.save(4, {"w": np.zeros(2)})
    assert os.path.isfile(blocker)
    moved = [n for n in os.listdir(tmp_path / "ck") if n.startswith("ckpt-000000000003.shoal.")]
    assert len(moved) == 1, os.listdir(tmp_path / "ck")
    assert (tmp_path / "ck" / moved[0] / "notes.txt").read_text() == "the user's"
    assert "in the way" in caplog.text and moved[0] in caplog.text
    assert ck.load_latest()[0] == 4


def test_an_old_slot_that_is_a_directory_does_not_break_pruning(tmp_path, caplog):
    ck = Checkpointer(tmp_path / "ck", keep=1, token=TOKEN)
    os.mkdir(ck.path(1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ck.save(2, {"w": np.zeros(2)})
        ck.save(3, {"w": np.zeros(2)})
    assert ck.steps() == [3]
    assert any(n.startswith("ckpt-000000000001.shoal.") for n in os.listdir(tmp_path / "ck"))


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_load_of_a_non_file_names_it(tmp_path, kind):
    ck = _two_good(tmp_path)
    (os.mkfifo if kind == "fifo" else os.mkdir)(ck.path(5))
    from shoal.elastic.checkpoint import CheckpointCorrupt
    with pytest.raises(CheckpointCorrupt, match="not a regular file"):
        ck.load(5)
