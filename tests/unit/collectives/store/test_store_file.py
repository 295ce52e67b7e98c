"""FileStore specifics: the last user removes the file, world_size is enforced, a torn record
left by a dead writer is dropped, and a stuck lock holder turns into a timeout."""

from __future__ import annotations

import fcntl
import gc
import multiprocessing
import os
import struct

import pytest

from shoal.collectives.types import StoreError
from shoal.collectives.store.file import FileStore


def _open_set_and_close(path, key):
    store = FileStore(path, timeout=10)
    store.set(key, b"from child")
    store.close()


def test_last_user_removes_the_file(tmp_path):
    path = tmp_path / "store"
    a = FileStore(path, timeout=5)
    b = FileStore(path, timeout=5)
    assert a.num_users() == 2
    a.set("k", "v")
    a.close()
    a.close()  # idempotent
    assert path.exists() and b.get("k") == b"v" and b.num_users() == 1
    b.close()
    assert not path.exists()


def test_garbage_collection_counts_as_closing(tmp_path):
    path = tmp_path / "store"
    a = FileStore(path, timeout=5)
    b = FileStore(path, timeout=5)
    del b
    gc.collect()
    assert a.num_users() == 1
    a.close()
    assert not path.exists()


def test_users_in_other_processes_are_counted(tmp_path):
    path = tmp_path / "store"
    store = FileStore(path, timeout=5)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_open_set_and_close, args=(str(path), "child"))
    child.start()
    child.join(30)
    assert child.exitcode == 0, f"child exited with {child.exitcode}"
    assert store.get("child", timeout=5) == b"from child"
    assert path.exists() and store.num_users() == 1
    store.close()
    assert not path.exists()


def test_a_path_reopened_after_removal_starts_empty(tmp_path):
    path = tmp_path / "store"
    with FileStore(path, timeout=5) as first:
        first.set("old", "1")
    with FileStore(path, timeout=5) as second:
        assert second.num_keys() == 0 and second.num_users() == 1


def _open_with_world_size(path, world_size):
    try:
        FileStore(path, world_size=world_size, timeout=10)
    except StoreError as exc:
        return str(exc)
    return "opened"


def test_more_processes_than_world_size_is_an_error(tmp_path):
    path = tmp_path / "store"
    a = FileStore(path, world_size=1, timeout=5)
    b = FileStore(path, world_size=1, timeout=5)  # one process may open it again (torch too)
    assert a.num_users() == 2
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        message = pool.apply(_open_with_world_size, (str(path), 1))
    assert message == (f"FileStore '{path}' would be open in 2 processes but world_size is 1; "
                       "is the file left over from an earlier job?")
    assert a.num_users() == 2
    a.close()
    b.close()
    assert not path.exists()


def test_torn_record_from_a_dead_writer_is_dropped(tmp_path, caplog):
    path = tmp_path / "store"
    store = FileStore(path, timeout=5)
    store.set("good", "1")
    size = path.stat().st_size
    with open(path, "ab") as f:  # a writer that died after half a record
        f.write(struct.pack("!BII", 1, 4, 100) + b"torn" + b"x" * 10)
    other = FileStore(path, timeout=5)  # its exclusive lock truncates the torn tail
    assert "dropping a torn record of 23 bytes" in caplog.text
    other.set("after", "2")
    assert store.multi_get(["good", "after"]) == [b"1", b"2"]
    assert not store.check(["torn"])
    assert path.stat().st_size > size
    other.close()
    store.close()


def test_unknown_record_kind_is_reported_as_corruption(tmp_path):
    path = tmp_path / "store"
    store = FileStore(path, timeout=5)
    with open(path, "ab") as f:
        f.write(struct.pack("!BII", 9, 1, 1) + b"kv")
    with pytest.raises(StoreError, match=rf"FileStore '{path}' is corrupt: record kind 9 at byte"):
        store.get("k", timeout=0)


def test_a_stuck_lock_holder_becomes_a_timeout(tmp_path):
    path = tmp_path / "store"
    store = FileStore(path, timeout=0.3)
    holder = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(StoreError, match=rf"FileStore could not lock '{path}' within 0\.3s"):
            store.set("k", "v")
    finally:
        os.close(holder)
    store.set("k", "v")
    assert store.get("k") == b"v"
    store.close()


def test_closed_store_refuses_calls(tmp_path):
    store = FileStore(tmp_path / "store", timeout=5)
    store.close()
    with pytest.raises(StoreError, match=r"This FileStore \('.*store'\) is closed\."):
        store.set("k", "v")
