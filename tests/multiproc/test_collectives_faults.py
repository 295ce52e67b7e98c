"""Fault handling of the tcp backend with real processes: a rank that never calls, a rank
SIGKILLed mid-allreduce, a SIGSTOPped rank, and SHOAL_ASYNC_ERROR_HANDLING's exit code.

Timeouts are short (a few seconds) on the things that should fail and generous on the waits
for things that should happen.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from tests.support.ranks import EVENTS, Ranks, agent_store

from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE


def _wait_failed(pg, seconds: float) -> str:
    """Wait until the group records a failure (relayed by a peer); return it."""
    end = time.monotonic() + seconds
    while pg.failure is None and time.monotonic() < end:
        time.sleep(0.02)
    return pg.failure


def _never_calls(rank, world, events):
    import shoal.collectives as c

    pg = c.init_process_group("tcp", init_method="env://", timeout=30)
    c.all_reduce(np.ones(4))  # a healthy collective first, so sequence numbers are past 1
    if rank == world - 1:
        return ("idle", _wait_failed(pg, 30))
    try:
        c.all_reduce(np.ones(1000), timeout=2)
    except c.CollectiveTimeout as exc:
        return ("timeout", str(exc))
    return ("ok", None)


def test_rank_that_never_calls_is_named_and_dumped(tmp_path):
    store, env = agent_store()
    env["SHOAL_DUMP_DIR"] = str(tmp_path)
    try:
        with Ranks(_never_calls, 3, (EVENTS,), env) as ranks:
            results = ranks.results(timeout=60)
    finally:
        store.close()
    for rank in (0, 1):
        status, (kind, message) = results[rank]
        assert status == "ok" and kind == "timeout", results[rank]
        # Both survivors name rank 2: one from its own watchdog, maybe one relayed.
        assert "rank 2 never arrived" in message, message
        assert "all_reduce #2" in message and "group 'default'" in message, message
    status, (kind, failure) = results[2]
    assert kind == "idle" and "rank 2 never arrived" in failure, results[2]
    dumps = sorted(tmp_path.glob("shoal-collectives-default-rank*.json"))
    assert dumps, "no dump was written"
    own = [d for d in dumps if "rank0" in d.name or "rank1" in d.name]
    doc = json.loads(own[0].read_text())
    assert doc["group"] == "default" and doc["world_size"] == 3
    last = doc["entries"][-1]
    assert last["op"] == "all_reduce" and last["seq"] == 2 and last["state"] in ("running", "failed")
    # The message names the file it wrote.
    timed_out = [results[r][1][1] for r in (0, 1) if "timed out after 2s" in results[r][1][1]]
    assert timed_out and any(str(tmp_path) in m for m in timed_out), timed_out


def _loop_until_killed(rank, world, events):
    import shoal.collectives as c

    c.init_process_group("tcp", init_method="env://", timeout=60)
    a = np.ones(4 * 1024 * 1024, np.float32)
    for i in range(10_000):
        if i == 3 and rank == world - 1:
            events.put(("ready", os.getpid()))
        try:
            c.all_reduce(a, op=c.ReduceOp.MAX)
        except c.PeerLost as first:
            failed_at = time.time()
            try:
                c.all_reduce(np.ones(3))
            except c.PeerLost as second:
                return (str(first), failed_at, str(second))
            return (str(first), failed_at, "next collective did not fail")
    return ("never failed", None, None)


def test_sigkilled_rank_fails_the_others_within_seconds():
    store, env = agent_store()
    try:
        with Ranks(_loop_until_killed, 3, (EVENTS,), env) as ranks:
            assert ranks.event(timeout=60)[0] == "ready"
            killed_at = time.time()
            ranks.kill(2, signal.SIGKILL)
            results = ranks.results(timeout=30, ranks=[0, 1])
    finally:
        store.close()
    for rank in (0, 1):
        status, (first, failed_at, second) = results[rank]
        assert status == "ok", results[rank]
        assert "rank 2" in first and ("was lost" in first or "connection" in first), first
        assert failed_at - killed_at < 5.0, f"rank {rank} noticed after {failed_at - killed_at:.1f}s"
        assert "rank 2" in second, second


def _stopped(rank, world, n, events):
    import shoal.collectives as c

    pg = c.init_process_group("tcp", init_method="env://", timeout=30)
    c.barrier()
    if rank == world - 1:
        events.put(("stop me", os.getpid()))
        time.sleep(60)  # SIGSTOPped here, then SIGKILLed
        return ("not stopped", None)
    # Make sure rank 2 is stopped before calling (the parent confirms through the store).
    pg._store.wait(["test/stopped"], timeout=30)
    t0 = time.monotonic()
    try:
        c.all_reduce(np.ones(n, np.float32), timeout=3)
    except c.CollectiveTimeout as exc:
        return (str(exc), time.monotonic() - t0)
    return ("no timeout", None)


# 10 elements take the small-message exchange; 1M the shared-memory path (same-host default).
@pytest.mark.parametrize("n", [10, 1_000_000])
def test_sigstopped_rank_times_out_naming_it(n):
    store, env = agent_store()
    try:
        with Ranks(_stopped, 3, (n, EVENTS), env) as ranks:
            assert ranks.event(timeout=60)[0] == "stop me"
            ranks.kill(2, signal.SIGSTOP)
            store.set("test/stopped", "1")
            results = ranks.results(timeout=40, ranks=[0, 1])
            ranks.kill(2, signal.SIGKILL)
    finally:
        store.close()
    for rank in (0, 1):
        status, (message, took) = results[rank]
        assert status == "ok", results[rank]
        assert "rank 2 never arrived" in message and "timed out after 3s" in message, message
        assert took < 15, took


def _async_error(rank, world, events):
    import shoal.collectives as c

    pg = c.init_process_group("tcp", init_method="env://", timeout=30)
    c.barrier()
    if rank == 0:
        c.all_reduce(np.ones(10), timeout=2)  # rank 1 never joins: the process ends here
        return "survived"
    _wait_failed(pg, 30)
    c.barrier()  # the group failed: this collective fails, which ends the process
    return "survived"


def test_async_error_handling_exits_with_its_code(tmp_path):
    store, env = agent_store()
    env.update(SHOAL_ASYNC_ERROR_HANDLING="1", SHOAL_DUMP_DIR=str(tmp_path))
    try:
        with Ranks(_async_error, 2, (EVENTS,), env) as ranks:
            codes = ranks.join(timeout=60)
    finally:
        store.close()
    assert codes == {0: ASYNC_ERROR_EXIT_CODE, 1: ASYNC_ERROR_EXIT_CODE}, codes
    assert ASYNC_ERROR_EXIT_CODE == 75
    dumps = list(tmp_path.glob("*.json"))
    assert any("rank0" in d.name for d in dumps), dumps
    for d in dumps:
        json.loads(d.read_text())


class _LateReader:
    """A data socket whose owner pauses once, for `delay`, after reading `after` bytes."""

    def __init__(self, sock, after: int, delay: float):
        self._sock = sock
        self._after = after
        self._delay = delay
        self._read = 0

    def _pause(self) -> None:
        if self._delay and self._read >= self._after:
            time.sleep(self._delay)
            self._delay = 0.0

    def recv_into(self, *args):
        self._pause()
        k = self._sock.recv_into(*args)
        self._read += k
        return k

    def recvmsg_into(self, *args):
        self._pause()
        got = self._sock.recvmsg_into(*args)
        self._read += got[0]
        return got

    def __getattr__(self, name):
        return getattr(self._sock, name)


_SEGMENT = 64 * 1024  # float32 elements per rank: the ring's pumped path, one chunk a segment


def _dies_after_its_allreduce(rank, world, how, events):
    import shoal.collectives as c

    pg = c.init_process_group("tcp", init_method="env://", timeout=30)
    c.barrier()
    x = np.arange(world * _SEGMENT, dtype=np.float32) * (rank + 1)
    if rank == 2:
        # Ring 0 -> 1 -> 2 -> 0. Rank 2 stops reading from rank 1 before the last segment of the
        # all-gather, which rank 1 can still send and finish without; rank 2 then still has to
        # read it and forward rank 1's segment to rank 0, long after rank 1 is dead.
        rx = pg._mesh.rx  # the receiving connections by peer, shared by every algorithm
        rx[1].sock = _LateReader(rx[1].sock, 3 * 4 * _SEGMENT, 1.5)
    c.all_reduce(x)
    if rank == 1:
        events.put(("done", os.getpid()))
        events.close()
        events.join_thread()  # the event must leave before the process does
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    np.testing.assert_array_equal(x, np.arange(world * _SEGMENT, dtype=np.float32) * 6)
    try:
        c.all_reduce(np.ones(3))
    except c.PeerLost as exc:
        return str(exc)
    return "the next collective did not fail"


@pytest.mark.parametrize("transport,how", [("tcp", "sigkill"), ("unix", "exit")])
def test_collective_completes_when_a_peer_dies_right_after_it(transport, how):
    # The dead rank handed every byte to the kernel before dying: the collective its peers
    # are still running must complete on those bytes, and only the next one fails naming it.
    store, env = agent_store()
    env["SHOAL_LOCAL_TRANSPORT"] = transport
    try:
        with Ranks(_dies_after_its_allreduce, 3, (how, EVENTS), env) as ranks:
            assert ranks.event(timeout=60)[0] == "done"
            results = ranks.results(timeout=30, ranks=[0, 2])
    finally:
        store.close()
    for rank in (0, 2):
        status, message = results[rank]
        assert status == "ok", results[rank]
        assert "rank 1" in message and "was lost" in message, message
