"""Shared-memory all_reduce of the tcp backend (ranks as threads, real sockets and memfds):
results against numpy, buffer rotation across calls, agreement on fallback, mismatches and
aborts on the shared-memory path. The region checks that keep a peer from hurting us are in
tests/unit/collectives/backends/tcp/test_shm_regions.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shoal.collectives.backends.tcp import shm
from shoal.collectives import env
from shoal.collectives.types import CollectiveMismatch, CollectiveTimeout, ReduceOp
from shoal.collectives.constants import SHM_SLOT_BYTES
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from tests.support.threaded_ranks import form_groups, run_all


def make_groups(world: int, timeout: float = 10.0):
    store = HashStore()
    return form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=timeout))


def _shutdown(pgs):
    for pg in pgs:
        pg.shutdown()


def _data(rank: int, n: int, dtype, salt: int) -> np.ndarray:
    rng = np.random.default_rng(100 * rank + salt)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-50, 50, n).astype(dtype)


# Element counts around the chunking: one partial chunk, exactly one slot, several chunks with
# a ragged tail, and counts not divisible by the world size.
def _counts(dtype: str) -> list[int]:
    slot = SHM_SLOT_BYTES // np.dtype(dtype).itemsize
    return [20_003, slot, 3 * slot + 5] if dtype == "float32" else [20_003, slot + 17]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_through_shared_memory_matches_numpy(world):
    pgs = make_groups(world)
    try:
        assert all(pg.uses_shared_memory for pg in pgs), "shared memory was not set up"

        def fn(pg, r):
            got = []
            salt = 0
            for dtype in ("float32", "float64", "int32"):
                for n in _counts(dtype):
                    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.AVG):
                        if op is ReduceOp.AVG and dtype == "int32":
                            continue
                        if op in (ReduceOp.PRODUCT, ReduceOp.MIN) and n > 100_000:
                            continue  # the same code path as MAX; keeps the test short
                        salt += 1
                        x = _data(r, n, dtype, salt)
                        pg.all_reduce(x, op=op)
                        got.append((dtype, n, op, salt, x))
            return got

        results = run_all(pgs, fn, timeout=90)
        for r, out in enumerate(results):
            assert not isinstance(out, BaseException), f"rank {r} raised {out!r}"
        for i, (dtype, n, op, salt, _) in enumerate(results[0]):
            inputs = [_data(r, n, dtype, salt) for r in range(world)]
            uf = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum,
                  ReduceOp.MIN: np.minimum, ReduceOp.PRODUCT: np.multiply}[op]
            want = inputs[0].astype(np.float64)
            for x in inputs[1:]:
                want = uf(want, x.astype(np.float64))
            if op is ReduceOp.AVG:
                want = want / world
            for r in range(world):
                got = results[r][i][4]
                # Every rank holds bitwise the same result: each element is reduced once.
                np.testing.assert_array_equal(got, results[0][i][4], err_msg=f"rank {r} vs 0, {dtype}[{n}] {op}")
            tol = 1e-5 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(results[0][i][4].astype(np.float64), want, rtol=tol, atol=tol,
                                       err_msg=f"{dtype}[{n}] {op.name}")
    finally:
        _shutdown(pgs)


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_and_all_gather_through_shared_memory(world):
    pgs = make_groups(world)
    slot = SHM_SLOT_BYTES // 8
    counts = [9_000, 3 * slot + 11]  # one chunk; several chunks with a ragged tail
    try:
        def fn(pg, r):
            out = []
            for i, n in enumerate(counts):
                for root in range(world):
                    x = _data(r, n, "float64", 7 * i + root)
                    pg.broadcast(x, src=root)
                    out.append(("broadcast", n, root, x))
                mine = _data(r, n, "int64", 50 + i)
                gathered = [np.empty(n, np.int64) for _ in range(world)]
                pg.all_gather(gathered, mine)
                out.append(("all_gather", n, None, gathered))
            return out

        results = run_all(pgs, fn, timeout=60)
        for r, out in enumerate(results):
            assert not isinstance(out, BaseException), f"rank {r} raised {out!r}"
            for (what, n, root, got), i in zip(out, [0] * (world + 1) + [1] * (world + 1)):
                if what == "broadcast":
                    np.testing.assert_array_equal(got, _data(root, n, "float64", 7 * i + root),
                                                  err_msg=f"rank {r}: broadcast[{n}] from {root}")
                else:
                    for q in range(world):
                        np.testing.assert_array_equal(got[q], _data(q, n, "int64", 50 + i),
                                                      err_msg=f"rank {r}: all_gather[{n}] part {q}")
    finally:
        _shutdown(pgs)


def test_buffers_rotate_across_calls_without_corruption():
    # Many back-to-back calls of 1, 2 and 4 chunks, with one rank slowed down so the others
    # run ahead into the next call while it still reads the previous one's buffers.
    pgs = make_groups(3)
    slot = SHM_SLOT_BYTES // 4
    try:
        def fn(pg, r):
            sums = []
            for i, n in enumerate([slot // 2, slot + 3, 20_000, 4 * slot - 1, slot // 2] * 3):
                x = np.full(n, float(r + i), np.float32)
                x[-1] = r * 1000.0 + i
                if r == 1:
                    np.dot(np.ones(200_000), np.ones(200_000))  # a little late, every call
                pg.all_reduce(x)
                sums.append((float(x[0]), float(x[n // 2]), float(x[-1])))
                if i % 2:  # the other shared-memory collectives advance the same buffers
                    b = np.full(slot + 1, float(r), np.float32)
                    pg.broadcast(b, src=i % 3)
                    assert b[0] == b[-1] == i % 3
            return sums

        results = run_all(pgs, fn, timeout=60)
        sizes = [slot // 2, slot + 3, 20_000, 4 * slot - 1, slot // 2] * 3
        want = [(3.0 + 3 * i, 3.0 + 3 * i, 3000.0 + 3 * i) for i in range(len(sizes))]
        assert results == [want] * 3
    finally:
        _shutdown(pgs)


def test_every_rank_falls_back_to_sockets_when_one_cannot_map(monkeypatch):
    real = shm._create_region
    store = HashStore()

    def make(r):
        return ProcessGroupTCP(store, r, 3, timeout=10.0)

    calls = {"n": 0}

    def flaky(nbytes):
        calls["n"] += 1
        if calls["n"] == 2:  # exactly one of the three ranks cannot create its region
            raise OSError(12, "Cannot allocate memory")
        return real(nbytes)

    monkeypatch.setattr(shm, "_create_region", flaky)
    pgs = form_groups(3, make)
    try:
        assert not any(pg.uses_shared_memory for pg in pgs)

        def fn(pg, r):
            x = np.full(300_000, r + 1.0, np.float32)
            pg.all_reduce(x)
            return float(x[0]), float(x[-1])

        assert run_all(pgs, fn) == [(6.0, 6.0)] * 3
    finally:
        _shutdown(pgs)


@pytest.mark.parametrize("n", [1000, 300_000])  # the small exchange and the shared-memory path
def test_two_ranks_agree_bitwise_where_operand_order_matters(n):
    # max(+0.0, -0.0) and max(nan_a, nan_b) return their first operand, and complex products
    # round differently with the operands swapped: both ranks must use the same order.
    pgs = make_groups(2)
    try:
        def fn(pg, r):
            zeros = np.full(n, 0.0 if r == 0 else -0.0, np.float32)
            pg.all_reduce(zeros, op=ReduceOp.MAX)
            nans = np.full(n, np.nan, np.float32).view(np.uint32)
            nans |= r + 1  # a different NaN payload per rank
            nans = nans.view(np.float32)
            pg.all_reduce(nans, op=ReduceOp.MIN)
            rng = np.random.default_rng(r)
            c = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
            pg.all_reduce(c, op=ReduceOp.PRODUCT)
            return zeros.tobytes(), nans.tobytes(), c.tobytes()

        a, b = run_all(pgs, fn, timeout=30)
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
        for what, x, y in zip(("max of signed zeros", "min of NaNs", "complex product"), a, b):
            assert x == y, f"ranks 0 and 1 disagree on the {what}"
        # And it is the rank-order answer x_0 op x_1.
        want = np.maximum(np.full(n, 0.0, np.float32), np.full(n, -0.0, np.float32))
        assert a[0] == want.tobytes()
    finally:
        _shutdown(pgs)


def test_ranks_in_different_modes_agree_on_sockets(monkeypatch):
    store = HashStore()

    # One rank asks for sockets only (as if started with SHOAL_LOCAL_TRANSPORT=unix); the
    # others would use shared memory. Ranks are threads here, so the mode is per thread.
    modes = {"rank-1": "unix"}
    monkeypatch.setattr(env, "local_transport",
                        lambda: modes.get(threading.current_thread().name, "shm"))
    pgs = form_groups(3, lambda r: ProcessGroupTCP(store, r, 3, timeout=10.0))
    try:
        assert not any(pg.uses_shared_memory for pg in pgs)

        def fn(pg, r):
            x = np.full(300_000, r + 1.0, np.float32)
            pg.all_reduce(x)
            return float(x[0])

        assert run_all(pgs, fn) == [6.0] * 3
    finally:
        _shutdown([pg for pg in pgs if pg is not None])


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_shared_memory_only_in_its_mode(monkeypatch, transport):
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", transport)
    pgs = make_groups(2)
    try:
        assert not any(pg.uses_shared_memory for pg in pgs)
        assert pgs[0]._mesh.transports == ["self", transport]
    finally:
        _shutdown(pgs)


def test_mismatched_sizes_on_the_shared_memory_path_name_both_calls():
    pgs = make_groups(3)
    try:
        def fn(pg, r):
            with pytest.raises(CollectiveMismatch) as info:
                pg.all_reduce(np.ones(300_000 if r != 2 else 300_001, np.float32))
            return str(info.value)

        messages = run_all(pgs, fn, timeout=30)
        for m in messages:
            assert isinstance(m, str), m
            assert "all_reduce(float32[300000], op=SUM)" in m or "all_reduce(float32[300001], op=SUM)" in m, m
    finally:
        _shutdown(pgs)


def test_a_rank_that_never_arrives_times_out_on_the_shared_memory_path():
    pgs = make_groups(3)
    try:
        def fn(pg, r):
            if r == 2:
                return "idle"
            with pytest.raises(CollectiveTimeout, match="rank 2 never arrived"):
                pg.all_reduce(np.ones(2_000_000, np.float32), timeout=1.0)
            return "timed out"

        assert run_all(pgs, fn, timeout=30) == ["timed out", "timed out", "idle"]
    finally:
        _shutdown(pgs)
