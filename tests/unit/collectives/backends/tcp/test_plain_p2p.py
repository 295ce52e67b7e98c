"""Plain send/recv and isend/irecv on the tcp backend, outside batch_isend_irecv: an isend on
an idle group runs in the caller's thread (no worker thread, no hand-off), a receive without
a deadline reads its source's connection itself, and both still order, match and fail as
before. Two real groups, one per thread; fresh groups per test, since whether a group's
worker thread exists is part of what is checked."""

from __future__ import annotations

import threading
import time

import numpy as np

from tests.support.threaded_ranks import form_groups, run_all

import shoal.collectives as c
from shoal.collectives.backends.tcp.group import EAGER_SEND_MAX_BYTES, ProcessGroupTCP
from shoal.collectives.constants import SMALL_MAX_BYTES
from shoal.collectives.store.hash import HashStore
from shoal.collectives.types import CollectiveError


def _groups(timeout: float = 20.0):
    store = HashStore()
    return form_groups(2, lambda r: ProcessGroupTCP(store, r, 2, timeout=timeout))


def _close(groups) -> None:
    run_all(groups, lambda pg, r: pg.shutdown())  # together: each waits for the other's goodbye


def _worker_started(pg) -> bool:
    return pg._executor._worker is not None


def test_small_isends_on_an_idle_group_run_in_the_callers_thread():
    groups = _groups()
    try:
        def body(pg, r):
            got = []
            for i in range(20):  # 4 KiB, an exchange each time: rank 0 sends first
                x = np.full(1024, 100 * r + i, np.float32)
                y = np.zeros(1024, np.float32)
                if r == 0:
                    work = c.isend(x, 1, group=pg, tag=3)
                    assert work.is_completed()  # done before isend returned
                    c.recv(y, 1, group=pg, tag=3)
                    work.wait()
                else:
                    c.recv(y, 0, group=pg, tag=3)
                    c.isend(x, 0, group=pg, tag=3).wait()
                got.append(y[0])
            return got, _worker_started(pg)

        out = run_all(groups, body)
        for r, result in enumerate(out):
            assert not isinstance(result, BaseException), result
            got, worker = result
            assert got == [100 * (1 - r) + i for i in range(20)]
            # Sends inline and blocking receives inline: the worker thread never started.
            assert not worker
    finally:
        _close(groups)


def test_an_isend_behind_queued_work_keeps_its_place():
    # An isend may run inline only when nothing is queued before it: behind an irecv that
    # waits, it is queued, and the messages still leave in the order the calls were made.
    groups = _groups()
    try:
        def body(pg, r):
            if r == 0:
                y = np.zeros(4, np.float32)
                pending = c.irecv(y, 1, group=pg, tag=1)  # queued: its message comes last
                first = c.isend(np.full(4, 1.0, np.float32), 1, group=pg, tag=2)
                second = c.isend(np.full(4, 2.0, np.float32), 1, group=pg, tag=2)
                pending.wait()
                first.wait()
                second.wait()
                return float(y[0])
            a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
            time.sleep(0.2)  # rank 0's isends wait behind its irecv meanwhile
            c.send(np.full(4, 9.0, np.float32), 0, group=pg, tag=1)
            c.recv(a, 0, group=pg, tag=2)
            c.recv(b, 0, group=pg, tag=2)
            return float(a[0]), float(b[0])

        out = run_all(groups, body)
        assert out[0] == 9.0
        assert out[1] == (1.0, 2.0)
    finally:
        _close(groups)


def test_a_large_isend_within_a_host_still_goes_to_the_worker_thread():
    groups = _groups()
    try:
        assert all(pg._mail is not None for pg in groups)
        n = EAGER_SEND_MAX_BYTES // 4 + 1  # float32 elements: just over the bound

        def body(pg, r):
            if r == 0:
                c.isend(np.ones(n, np.float32), 1, group=pg).wait()
                return _worker_started(pg)
            y = np.zeros(n, np.float32)
            c.recv(y, 0, group=pg)
            return float(y.sum())

        assert run_all(groups, body) == [True, float(n)]
    finally:
        _close(groups)


def test_a_large_isend_over_the_sockets_still_goes_to_the_worker_thread(monkeypatch):
    # Without shared memory (as between hosts; here by asking for sockets), a payload above
    # what the sockets' buffers take whole could block the caller: it stays asynchronous, in
    # the worker thread. A small one still runs inline.
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", "tcp")
    groups = _groups()
    try:
        assert all(pg._mail is None for pg in groups)
        n = SMALL_MAX_BYTES  # float32 elements: 4x the small-message bound in bytes

        def body(pg, r):
            if r == 0:
                small = c.isend(np.ones(16, np.float32), 1, group=pg)
                inline_small = small.is_completed() and not _worker_started(pg)
                c.isend(np.ones(n, np.float32), 1, group=pg).wait()
                return inline_small, _worker_started(pg)
            y, z = np.zeros(16, np.float32), np.zeros(n, np.float32)
            c.recv(y, 0, group=pg)
            c.recv(z, 0, group=pg)
            return float(y.sum()), float(z.sum())

        out = run_all(groups, body)
        assert out[0] == (True, True)
        assert out[1] == (16.0, float(n))
    finally:
        _close(groups)


def test_a_blocking_recv_ends_when_the_group_is_aborted():
    # The receive reads its source's connection in slices and checks the group between them:
    # an abort from another thread of this rank ends it within a slice or two.
    groups = _groups(timeout=60.0)
    try:
        pg = groups[0]
        errors = []

        def receive():
            try:
                c.recv(np.zeros(4, np.float32), 1, group=pg)
            except CollectiveError as exc:
                errors.append((time.monotonic(), exc))

        thread = threading.Thread(target=receive)
        thread.start()
        time.sleep(0.3)  # the receive is reading rank 1's connection by now
        aborted = time.monotonic()
        pg.abort()
        thread.join(5.0)
        assert not thread.is_alive()
        assert errors and errors[0][0] - aborted < 2.0  # the slice is 0.25 s
    finally:
        for g in groups:
            try:
                g.abort()
            except Exception:  # noqa: BLE001  (aborted already)
                pass
