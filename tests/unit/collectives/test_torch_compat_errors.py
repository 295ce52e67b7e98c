"""torch.distributed's exception tree: DistError and its Store/Network/Backend kinds, side by
side with torch on the same failures (a store get that times out, a second server on a busy
port, a client with no server), and shoal's own classes still catching what they caught."""

from __future__ import annotations

import datetime
import errno
import socket

import pytest

import shoal.collectives as dist
from shoal.collectives.store.tcp import TCPStore

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
    assert isinstance(info.value, (dist.StoreTimeout, TimeoutError))
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
