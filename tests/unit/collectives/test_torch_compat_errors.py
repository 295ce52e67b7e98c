"""torch.distributed's exception tree: DistError and its Store/Network/Backend kinds, side by
side with torch on the same failures (a store get that times out, a second server on a busy
port, a client with no server), and shoal's own classes still catching what they caught."""

from __future__ import annotations

import datetime
import errno
import re
import socket

import numpy as np
import pytest

import shoal.collectives as dist
from shoal.collectives import ProcessGroupTCP
from shoal.collectives.store.tcp import TCPStore
from tests.support.thread_world import ThreadWorld, on_threads

pytestmark = pytest.mark.timeout(60)
TORCH_NAMES = ("DistError", "DistStoreError", "DistNetworkError", "DistBackendError")


def _torch_dist():
    torch_dist = pytest.importorskip("torch.distributed")
    if not torch_dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    return torch_dist


def _same_kind(shoal_exc: BaseException, torch_exc: BaseException) -> None:
    """shoal's error is an instance of the shoal class of each torch name torch's is one of."""
    torch_dist = _torch_dist()
    for name in TORCH_NAMES:
        assert isinstance(shoal_exc, getattr(dist, name)) == isinstance(
            torch_exc, getattr(torch_dist, name)), (name, shoal_exc, torch_exc)
    assert isinstance(shoal_exc, RuntimeError) and isinstance(torch_exc, RuntimeError)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_tree_is_torchs():
    torch_dist = _torch_dist()
    for name in TORCH_NAMES:
        ours, theirs = getattr(dist, name), getattr(torch_dist, name)
        assert [c.__name__ for c in theirs.__mro__ if c.__name__ in TORCH_NAMES] == [
            c.__name__ for c in ours.__mro__ if c.__name__ in TORCH_NAMES]
        assert issubclass(ours, RuntimeError)


def test_a_store_timeout_is_a_dist_store_error_and_still_a_timeout():
    torch_dist = _torch_dist()
    theirs = torch_dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=0.2))
    with pytest.raises(RuntimeError) as torch_info:
        theirs.get("missing")
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=0.2)
    try:
        with pytest.raises(RuntimeError) as info:
            store.get("missing")
    finally:
        store.close()
    _same_kind(info.value, torch_info.value)
    for kind in (dist.StoreTimeout, TimeoutError, RuntimeError, dist.DistStoreError):
        assert isinstance(info.value, kind), kind
    assert "missing" in str(info.value)


def test_a_bind_failure_is_a_dist_network_error_and_still_an_oserror():
    torch_dist = _torch_dist()
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5)
    try:
        with pytest.raises(RuntimeError) as torch_info:
            torch_dist.TCPStore("127.0.0.1", store.port, 1, True)
        with pytest.raises(RuntimeError) as info:
            TCPStore("127.0.0.1", store.port, world_size=1, is_master=True, timeout=1)
    finally:
        store.close()
    _same_kind(info.value, torch_info.value)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EADDRINUSE
    assert f"TCPStore server cannot listen on 127.0.0.1:{store.port}" in str(info.value)


def test_no_server_is_a_dist_network_error():
    torch_dist = _torch_dist()
    port = _free_port()
    with pytest.raises(RuntimeError) as torch_info:
        torch_dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=0.3))
    with pytest.raises(RuntimeError) as info:
        TCPStore("127.0.0.1", port, world_size=2, timeout=0.3)
    _same_kind(info.value, torch_info.value)
    assert isinstance(info.value, dist.StoreError)
    assert f"could not reach the server at 127.0.0.1:{port} within 0.3s" in str(info.value)


def test_collective_errors_are_dist_backend_errors():
    assert issubclass(dist.CollectiveError, dist.DistBackendError)
    assert issubclass(dist.CollectiveTimeout, TimeoutError)
    assert issubclass(dist.PeerLost, ConnectionError)


def _make_group(store, rank, size, *, name, global_ranks, timeout):
    return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name, global_ranks=global_ranks)


def test_a_real_mismatch_is_caught_as_a_dist_backend_error():
    """Two thread ranks over a real tcp group call all_reduce with different shapes: each
    gets CollectiveMismatch, which `except DistBackendError` and `except RuntimeError` catch."""
    job = ThreadWorld(_make_group, 2)
    try:
        def body(rank):
            with pytest.raises(dist.DistBackendError) as info:
                job.pgs[rank].all_reduce(np.ones(2 + rank), timeout=10)
            return [info.value]  # in a list: a returned exception would count as a failure

        for rank, (exc,) in enumerate(job.run(body, timeout=30)):
            assert isinstance(exc, dist.CollectiveMismatch), rank
            assert isinstance(exc, dist.DistError) and isinstance(exc, RuntimeError), rank
            assert not isinstance(exc, dist.DistStoreError), rank
            # which rank noticed first decides the order the two calls are named in
            assert re.match(rf"^Rank {rank} failed all_reduce #1 of group 'default': rank \d "
                            r"called all_reduce\(float64\[\d\], op=SUM\) as collective #1 but "
                            r"rank \d called all_reduce\(float64\[\d\], op=SUM\) as #1", str(exc))
            assert "rank 1 called all_reduce(float64[3]" in str(exc)
            assert "rank 0 called all_reduce(float64[2]" in str(exc)
    finally:
        job.close()


def test_a_real_collective_timeout_is_caught_where_torchs_gloo_timeout_is():
    """Rank 1 never joins rank 0's all_reduce. torch's gloo raises a bare RuntimeError; shoal's
    CollectiveTimeout is one too, and a DistBackendError and a TimeoutError besides."""
    torch_dist = _torch_dist()
    import torch

    store = torch_dist.HashStore()
    torch_pgs = on_threads(lambda r: torch_dist.ProcessGroupGloo(
        store, r, 2, datetime.timedelta(seconds=0.5)), range(2), timeout=30)
    with pytest.raises(RuntimeError, match="Timed out"):
        torch_pgs[0].allreduce([torch.ones(2)]).wait()
    job = ThreadWorld(_make_group, 2)
    try:
        with pytest.raises(RuntimeError) as info:
            job.pgs[0].all_reduce(np.ones(2), timeout=0.5)
    finally:
        job.close()
    for kind in (dist.CollectiveTimeout, dist.DistBackendError, dist.DistError, TimeoutError):
        assert isinstance(info.value, kind), kind
    assert str(info.value).startswith("Rank 0 timed out after 0.5s in all_reduce #1 of group "
                                      "'default': rank 1 never arrived."), str(info.value)
