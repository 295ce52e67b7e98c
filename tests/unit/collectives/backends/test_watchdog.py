"""The watchdog with ranks as threads: who never arrived, dumps, per-call and per-group
timeouts, and monitored_barrier naming the missing ranks."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from shoal.collectives.types import CollectiveTimeout
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.collectives.backends.dump import write_dump
from tests.support.threaded_ranks import form_groups, run_all


def make_groups(world: int, timeout: float = 10.0):
    store = HashStore()
    return form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=timeout))


@pytest.fixture
def dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_DUMP_DIR", str(tmp_path))
    return tmp_path


def test_group_timeout_names_laggards_and_writes_a_valid_dump(dumps):
    pgs = make_groups(3, timeout=1.0)  # the group's default applies to every call
    try:
        def fn(pg, r):
            pg.all_reduce(np.ones(4))
            if r == 2:
                return None  # never calls the second collective
            t0 = time.monotonic()
            with pytest.raises(CollectiveTimeout) as info:
                pg.all_reduce(np.ones(4))
            return str(info.value), time.monotonic() - t0

        out = run_all(pgs, fn)
        own = [m for m, _ in out[:2] if m.startswith(("Rank 0 timed out", "Rank 1 timed out"))]
        assert own, out
        for message, took in out[:2]:
            assert "all_reduce #2 of group 'default'" in message and "rank 2 never arrived" in message, message
            assert took < 8, took
        path = own[0].split(" are in ")[1].rstrip(".")
        doc = json.loads(open(path).read())
        assert doc["rank"] in (0, 1) and doc["world_size"] == 3 and doc["group"] == "default"
        assert doc["failed_op"]["seq"] == 2 and doc["progress_of_ranks"]["2"][0] == 1
        assert [e["state"] for e in doc["entries"]] == ["completed", "running"]
        # The rank that never called learns why from its peers.
        deadline = time.monotonic() + 10
        while pgs[2].failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "rank 2 never arrived" in pgs[2].failure
    finally:
        for pg in pgs:
            pg.shutdown()


def test_per_call_timeout_beats_the_group_default(dumps):
    pgs = make_groups(2, timeout=600)
    try:
        def fn(pg, r):
            if r == 1:
                return None
            t0 = time.monotonic()
            with pytest.raises(CollectiveTimeout, match=r"Rank 0 timed out after 0.5s in barrier #1 of group 'default': rank 1 never arrived"):
                pg.barrier(timeout=0.5)
            return time.monotonic() - t0

        assert run_all(pgs, fn)[0] < 5
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.mark.parametrize("wait_all", [False, True])
def test_monitored_barrier_names_missing_ranks(dumps, wait_all):
    pgs = make_groups(4, timeout=30)
    try:
        def fn(pg, r):
            if r in (2, 3):
                return None
            with pytest.raises(CollectiveTimeout) as info:
                pg.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all)
            return str(info.value)

        out = run_all(pgs, fn)
        expected = "ranks 2, 3 did not reach monitored_barrier #1" if wait_all else "rank 2 did not reach monitored_barrier #1"
        for message in out[:2]:
            assert expected in message and "within 0.5s" in message, message
    finally:
        for pg in pgs:
            pg.shutdown()


def test_monitored_barrier_passes_when_everyone_arrives():
    pgs = make_groups(3)
    try:
        assert run_all(pgs, lambda pg, r: pg.monitored_barrier(timeout=10, wait_all_ranks=True)) == [None] * 3
    finally:
        for pg in pgs:
            pg.shutdown()


def test_dump_lists_recent_collectives(dumps):
    pgs = make_groups(2)
    try:
        run_all(pgs, lambda pg, r: [pg.all_reduce(np.ones(10)) for _ in range(3)])
        path = write_dump(pgs[0], "test", None, None)
        doc = json.loads(open(path).read())
        assert [e["seq"] for e in doc["entries"]] == [1, 2, 3]
        assert all(e["state"] == "completed" and e["call"] == "all_reduce(float64[10], op=SUM)"
                   for e in doc["entries"])
        assert doc["last_finished_seq"] == 3
    finally:
        for pg in pgs:
            pg.shutdown()
