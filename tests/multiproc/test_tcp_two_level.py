"""The two-level and shared-memory collectives of the tcp backend, with ranks as threads of one
process (real sockets and memfds); `Topology` itself is tested in
tests/unit/collectives/backends/tcp/test_topology.py.

Hosts are simulated by giving each rank's thread a host identity of its own choosing (the
identity `wire.host_identity` publishes): ranks "on" one host link by Unix sockets and share
memory, ranks on different ones link by TCP, exactly as across machines. The network-namespace
tests in tests/integration/test_multihost.py run the same algorithms across real namespaces;
here layouts that are awkward to launch (hosts of unequal size, every leader count) run in
seconds. Results are checked against numpy and bitwise across ranks.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from shoal.collectives.backends.tcp import hierarchical as hierarchical_mod
from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from shoal.collectives.types import CollectiveMismatch, ReduceOp
from tests.support.threaded_ranks import form_groups, run_all

# ----------------------------------------------------------------------------- groups

def make_groups(layout: list[int], monkeypatch, leaders=None):
    """Groups whose ranks sit on hosts of the given sizes (ranks numbered host by host)."""
    host_of = [h for h, n in enumerate(layout) for _ in range(n)]
    real = wire.host_identity

    def identity():
        name = threading.current_thread().name
        if name.startswith("rank-"):
            return f"{real()}/simulated-host-{host_of[int(name[5:])]}"
        return real()

    monkeypatch.setattr(wire, "host_identity", identity)
    if leaders is not None:
        monkeypatch.setenv("SHOAL_HIER_LEADERS", str(leaders))
    store = HashStore()
    world = len(host_of)
    return form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=20.0))


def _shutdown(pgs):
    for pg in pgs:
        pg.shutdown()


def data(rank: int, n: int, salt: int = 0, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    return rng.standard_normal(n).astype(dtype)


def _digest(x: np.ndarray) -> bytes:
    return hashlib.sha256(x.tobytes()).digest()


SALT = {ReduceOp.SUM: 1, ReduceOp.MAX: 2, ReduceOp.AVG: 3}
N_LARGE = 1_100_003  # several shared-memory steps, ragged against every split


def _catalogue(pg, r, world):
    """Every collective of the two levels on `pg`; returns what each produced."""
    got = {}
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
        x = data(r, N_LARGE, salt=SALT[op])
        pg.all_reduce(x, op=op)
        got[("all_reduce", op)] = x
    for src in range(world):
        x = data(r, 70_001, salt=50)
        pg.broadcast(x, src=src)
        got[("broadcast", src)] = x
    outs = [np.zeros(40_000, np.float32) for _ in range(world)]
    pg.all_gather(outs, data(r, 40_000, salt=60))
    got["all_gather"] = outs
    out = np.zeros(30_001, np.float32)
    pg.reduce_scatter(out, [data(r, 30_001, salt=70 + j) for j in range(world)])
    got["reduce_scatter"] = out
    x = data(r, 70_001, salt=80)
    pg.reduce(x, dst=world - 1)
    got["reduce"] = x
    return got


def _check_catalogue(results, world):
    for r, out in enumerate(results):
        assert not isinstance(out, BaseException), f"rank {r} raised {out!r}"
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
        inputs = [data(q, N_LARGE, salt=SALT[op])
                  for q in range(world)]
        want = {ReduceOp.SUM: sum(inputs), ReduceOp.MAX: np.maximum.reduce(inputs),
                ReduceOp.AVG: sum(inputs) / world}[op]
        first = results[0][("all_reduce", op)]
        np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-5)
        assert all(_digest(res[("all_reduce", op)]) == _digest(first) for res in results), op
    for src in range(world):
        for res in results:
            np.testing.assert_array_equal(res[("broadcast", src)], data(src, 70_001, salt=50))
    for res in results:
        for q in range(world):
            np.testing.assert_array_equal(res["all_gather"][q], data(q, 40_000, salt=60))
    for r, res in enumerate(results):
        want = sum(data(q, 30_001, salt=70 + r) for q in range(world))
        np.testing.assert_allclose(res["reduce_scatter"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[world - 1]["reduce"],
                               sum(data(q, 70_001, salt=80) for q in range(world)),
                               rtol=1e-5, atol=1e-5)
    for r in range(world - 1):  # torch leaves the other ranks' tensors as they were
        np.testing.assert_array_equal(results[r]["reduce"], data(r, 70_001, salt=80))


@pytest.mark.parametrize("layout, leaders, hierarchical, piece", [
    ([2, 2], 1, True, 1 << 20),
    ([2, 2], 2, True, None),
    ([3, 3], 2, True, 1 << 20),
    ([2, 1, 3], None, True, 1 << 20),  # unequal hosts: one leader each; all_gather and
                                       # reduce_scatter run flat
    ([1, 1, 1], None, False, None),
], ids=["2x2-k1-pipelined", "2x2-k2", "3x3-k2-pipelined", "2+1+3-pipelined", "3x1"])
def test_two_level_collectives_match_numpy_and_agree_bitwise(layout, leaders, hierarchical,
                                                             piece, monkeypatch):
    """`piece`: the all_reduce pipeline's piece size with SHOAL_HIER_PIPELINE=1 (1 MiB: the
    4.4 MB arrays go in five pieces, each leader's cross-host ring running in its courier
    thread); None: SHOAL_HIER_PIPELINE=0, the phases one after the other."""
    if piece is not None:
        monkeypatch.setattr(hierarchical_mod, "PIPELINE_PIECE_BYTES", piece)
    monkeypatch.setenv("SHOAL_HIER_PIPELINE", "1" if piece is not None else "0")
    pgs = make_groups(layout, monkeypatch, leaders)
    world = len(pgs)
    try:
        want_hosts = []
        r = 0
        for n in layout:
            want_hosts.append(tuple(range(r, r + n)))
            r += n
        assert all(pg.topology.hosts == tuple(want_hosts) for pg in pgs)
        assert all(pg.hierarchical == hierarchical for pg in pgs)
        if hierarchical:
            assert all(pg._links.hier.pipelined == (piece is not None) for pg in pgs)
        if leaders is not None:
            assert all(pg.topology.leaders_per_host == leaders for pg in pgs)
        # Unix sockets within a simulated host, TCP between them.
        host_of = [h for h, n in enumerate(layout) for _ in range(n)]
        for q, t in enumerate(pgs[0].transports[1:], start=1):
            assert t == ("unix" if host_of[q] == host_of[0] else "tcp"), pgs[0].transports
        results = run_all(pgs, lambda pg, r: _catalogue(pg, r, world), timeout=120)
        _check_catalogue(results, world)
    finally:
        _shutdown(pgs)


def test_ranks_that_disagree_on_shared_memory_all_run_flat(monkeypatch):
    """One rank refuses shared memory (SHOAL_HIERARCHICAL=0 read in its thread): every rank of
    the group must then run the flat algorithms, or they would wait on different protocols."""
    from shoal.collectives import env

    real = env.hierarchical_collectives
    monkeypatch.setattr(env, "hierarchical_collectives",
                        lambda: threading.current_thread().name != "rank-3" and real())
    pgs = make_groups([2, 2], monkeypatch)
    try:
        assert not any(pg.hierarchical for pg in pgs)
        results = run_all(pgs, lambda pg, r: _catalogue(pg, r, 4), timeout=120)
        _check_catalogue(results, 4)
    finally:
        _shutdown(pgs)


# ----------------------------------------------------------------------------- one host

def _one_host_catalogue(pg, r, world):
    got = {}
    n = 600_001  # several shared-memory steps at every world size
    gathered = [np.zeros(n, np.float32) for _ in range(world)] if r == 0 else None
    pg.gather(data(r, n, salt=1), gathered, dst=0)
    got["gather"] = gathered
    out = np.zeros(n, np.float32)
    pg.scatter(out, [data(q, n, salt=2) * 3 for q in range(world)] if r == 1 else None, src=1)
    got["scatter"] = out
    # all_to_all: rank a sends rank b a block of 50_000 * (a + 1) + b elements; one empty.
    size = lambda a, b: 0 if (a, b) == (0, 1) else 50_000 * (a + 1) + b  # noqa: E731
    ins = [data(r, size(r, b), salt=10 + b) for b in range(world)]
    outs = [np.zeros(size(a, r), np.float32) for a in range(world)]
    pg.all_to_all(outs, ins)
    got["all_to_all"] = outs
    out = np.zeros(n, np.float64)
    pg.reduce_scatter(out, [data(r, n, salt=20 + j, dtype=np.float64) for j in range(world)],
                      op=ReduceOp.AVG)
    got["reduce_scatter"] = out
    x = data(r, n, salt=30)
    pg.reduce(x, dst=2 % world, op=ReduceOp.MAX)
    got["reduce"] = x
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_paths_of_the_rooted_and_personalised_collectives(world, monkeypatch):
    pgs = make_groups([world], monkeypatch)
    try:
        assert all(pg.uses_shared_memory and not pg.hierarchical for pg in pgs)
        results = run_all(pgs, lambda pg, r: _one_host_catalogue(pg, r, world), timeout=120)
        for r, out in enumerate(results):
            assert not isinstance(out, BaseException), f"rank {r} raised {out!r}"
        n = 600_001
        for q in range(world):
            np.testing.assert_array_equal(results[0]["gather"][q], data(q, n, salt=1))
        size = lambda a, b: 0 if (a, b) == (0, 1) else 50_000 * (a + 1) + b  # noqa: E731
        for r, res in enumerate(results):
            np.testing.assert_array_equal(res["scatter"], data(r, n, salt=2) * 3)
            for a in range(world):
                np.testing.assert_array_equal(res["all_to_all"][a], data(a, size(a, r), salt=10 + r))
            want = sum(data(q, n, salt=20 + r, dtype=np.float64) for q in range(world)) / world
            np.testing.assert_allclose(res["reduce_scatter"], want, rtol=1e-12, atol=1e-15)
        dst = 2 % world
        np.testing.assert_array_equal(results[dst]["reduce"],
                                      np.maximum.reduce([data(q, n, salt=30) for q in range(world)]))
        for r in range(world):
            if r != dst:
                np.testing.assert_array_equal(results[r]["reduce"], data(r, n, salt=30))
    finally:
        _shutdown(pgs)


def test_all_to_all_blocks_that_disagree_fail_every_rank_naming_both(monkeypatch):
    pgs = make_groups([3], monkeypatch)
    try:
        def fn(pg, r):
            ins = [np.ones(100_000 + (7 if (r, b) == (2, 0) else 0), np.float32) for b in range(3)]
            outs = [np.zeros(100_000, np.float32) for _ in range(3)]
            pg.all_to_all(outs, ins)

        results = run_all(pgs, fn, timeout=60)
        for out in results:
            assert isinstance(out, CollectiveMismatch), out
            assert ("rank 2's all_to_all input_list[0] has 400028 bytes but rank 0's "
                    "output_list[2] has 400000") in str(out), out
    finally:
        _shutdown(pgs)


# ----------------------------------------------------------------------------- small messages

@pytest.mark.parametrize("layout", [[2, 2], [2, 1, 3], [5]], ids=["2x2", "2+1+3", "1x5"])
def test_small_all_reduce_as_a_tree_matches_numpy_and_agrees_bitwise(layout, monkeypatch):
    """Above DIRECT_MAX_RANKS ranks (lowered to 2 here) a small all_reduce runs as recursive
    doubling (the ranks beyond a power of two folded in), on one host, across one-rank hosts
    and across hosts of several ranks alike. Every rank ends bitwise equal, also for complex
    products, whose rounding depends on operand order."""
    from shoal.collectives.backends.tcp import over_sockets

    monkeypatch.setattr(over_sockets, "DIRECT_MAX_RANKS", 2)
    pgs = make_groups(layout, monkeypatch)
    world = len(pgs)
    cases = [(np.float32, ReduceOp.SUM), (np.float32, ReduceOp.MAX), (np.float64, ReduceOp.AVG),
             (np.complex64, ReduceOp.PRODUCT), (np.int64, ReduceOp.SUM)]

    def value(r, dtype, salt):
        rng = np.random.default_rng(10 * r + salt)
        x = rng.standard_normal(1001)
        if np.dtype(dtype).kind == "c":
            return (x + 1j * rng.standard_normal(1001)).astype(dtype)
        if np.dtype(dtype).kind == "i":
            return (x * 100).astype(dtype)
        return x.astype(dtype)

    try:
        def fn(pg, r):
            got = []
            for salt, (dtype, op) in enumerate(cases):
                x = value(r, dtype, salt)
                pg.all_reduce(x, op=op)
                got.append(x)
            return got

        results = run_all(pgs, fn, timeout=60)
        for r, out in enumerate(results):
            assert not isinstance(out, BaseException), f"rank {r} raised {out!r}"
        for i, (dtype, op) in enumerate(cases):
            inputs = [value(q, dtype, i) for q in range(world)]
            want = {ReduceOp.SUM: lambda: sum(inputs), ReduceOp.MAX: lambda: np.maximum.reduce(inputs),
                    ReduceOp.AVG: lambda: sum(inputs) / world,
                    ReduceOp.PRODUCT: lambda: np.prod(np.stack(inputs), axis=0)}[op]()
            np.testing.assert_allclose(results[0][i], want, rtol=1e-5, atol=1e-5)
            assert all(_digest(res[i]) == _digest(results[0][i]) for res in results), (dtype, op)
    finally:
        _shutdown(pgs)
