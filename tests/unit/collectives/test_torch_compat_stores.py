"""torch's Store API on shoal's stores, side by side with torch's own store of the same kind:
delete_key, append, has_extended_api, clone, TCPStore(host_name=...), multi_tenant masters
sharing one port, a FileStore opened several times in one process, a bare Store subclass, and
collectives.rendezvous."""

from __future__ import annotations

import datetime

import pytest

import shoal.collectives as dist
from shoal.collectives.store.file import FileStore
from shoal.collectives.store.hash import HashStore
from shoal.collectives.store.prefix import PrefixStore
from shoal.collectives.store.tcp import TCPStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def td():
    torch_dist = pytest.importorskip("torch.distributed")
    if not torch_dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    return torch_dist


def _pairs(td, tmp_path):
    """(name, torch store, shoal store) of each kind."""
    t_tcp = td.TCPStore(host_name="127.0.0.1", port=0, world_size=1, is_master=True,
                        timeout=datetime.timedelta(seconds=5))
    s_tcp = TCPStore(host_name="127.0.0.1", port=0, world_size=1, is_master=True, timeout=5)
    return [
        ("tcp", t_tcp, s_tcp),
        ("file", td.FileStore(str(tmp_path / "t"), 1), FileStore(tmp_path / "s", 1, timeout=5)),
        ("hash", td.HashStore(), HashStore(timeout=5)),
        ("prefix", td.PrefixStore("p", td.HashStore()), PrefixStore("p", HashStore(timeout=5))),
    ]


def test_extended_api_as_torch(td, tmp_path):
    for name, theirs, ours in _pairs(td, tmp_path):
        for store in (theirs, ours):
            store.append("log", "a")
            store.append("log", b"bc")
            store.set("gone", "1")
        assert ours.get("log") == theirs.get("log") == b"abc", name
        # every shoal store has append/multi_get/multi_set; torch's FileStore says False
        assert ours.has_extended_api() is True and theirs.has_extended_api() is (name != "file"), name
        deleted = (theirs.delete_key("gone"), theirs.delete_key("gone"))
        # torch's FileStore answers True for a key already gone; the others say False
        assert deleted == ((True, True) if name == "file" else (True, False)), name
        assert (ours.delete_key("gone"), ours.delete_key("gone")) == (True, False), name
        assert not ours.check(["gone"])
        if name in ("tcp", "prefix"):  # torch's FileStore and HashStore have no clone
            twin, their_twin = ours.clone(), theirs.clone()
            assert twin.get("log") == their_twin.get("log") == b"abc", name
            twin.append("log", "d")
            assert ours.get("log") == b"abcd", name
        if hasattr(ours, "close"):
            ours.close()


def test_clone_of_each_shoal_store(tmp_path):
    file_store = FileStore(tmp_path / "f", timeout=5)
    twin = file_store.clone()
    assert twin.num_users() == 2
    twin.set("k", "v")
    assert file_store.get("k") == b"v"
    twin.close()
    file_store.close()
    hash_store = HashStore(timeout=5)
    assert hash_store.clone() is hash_store


def test_host_name_and_bad_hosts():
    with pytest.raises(ValueError, match="TCPStore got host='a' and host_name='b'; pass one."):
        TCPStore("a", 1, host_name="b")
    with pytest.raises(ValueError, match=r"TCPStore needs the server's host \(host= or host_name=\), got None."):
        TCPStore(port=1)
    with pytest.raises(ValueError, match="master_listen_fd is not supported"):
        TCPStore("127.0.0.1", 0, is_master=True, master_listen_fd=3)


def test_multi_tenant_masters_share_one_server(td):
    first = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5, multi_tenant=True)
    second = TCPStore("127.0.0.1", first.port, world_size=1, is_master=True, timeout=5,
                      multi_tenant=True)
    # torch does the same with multi_tenant on both
    t_first = td.TCPStore("127.0.0.1", 0, 1, True, multi_tenant=True)
    t_second = td.TCPStore("127.0.0.1", t_first.port, 1, True, multi_tenant=True)
    for a, b in ((first, second), (t_first, t_second)):
        a.set("from first", "1")
        assert b.get("from first") == b"1"
    first.close()
    assert second.get("from first") == b"1"  # the server lives on until its last master closes
    second.close()
    with pytest.raises(dist.StoreUnreachable):
        TCPStore("127.0.0.1", first.port, timeout=0.3)


def test_without_multi_tenant_a_second_master_cannot_bind(td):
    first = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5)
    try:
        with pytest.raises(td.DistNetworkError):
            td.TCPStore("127.0.0.1", first.port, 1, True)
        with pytest.raises(dist.DistNetworkError, match="TCPStore server cannot listen on"):
            TCPStore("127.0.0.1", first.port, world_size=1, is_master=True, timeout=5)
    finally:
        first.close()


def test_a_file_store_opened_several_times_in_one_process(td, tmp_path):
    theirs = [td.FileStore(str(tmp_path / "t"), 1) for _ in range(3)]
    ours = [FileStore(tmp_path / "s", world_size=1, timeout=5) for _ in range(3)]
    for stores in (theirs, ours):
        stores[0].set("k", "v")
        assert [s.get("k") for s in stores[1:]] == [b"v", b"v"]
    for s in ours:
        s.close()
    assert not (tmp_path / "s").exists()


def test_a_bare_store_subclass(td):
    class Theirs(td.Store):
        pass

    class Ours(dist.Store):
        def __init__(self):
            super().__init__()
            self.data = {}

        def set(self, key, value):  # torch-style: override only what is used
            self.data[key] = value

    with pytest.raises(RuntimeError, match="Not implemented"):
        Theirs().set("a", "b")
    store = Ours()
    store.set("a", "b")
    assert store.data == {"a": "b"}
    for call, name in ((lambda: store.get("a"), "get"), (lambda: store.add("n", 1), "add"),
                       (lambda: store.delete_key("a"), "delete_key"), (store.clone, "clone"),
                       (lambda: store.wait(["a"]), "wait"), (store.num_keys, "num_keys")):
        with pytest.raises(NotImplementedError, match=rf"^Ours does not implement {name}: this store "
                                                      r"type is not implemented for it"):
            call()
    assert isinstance(NotImplementedError(), RuntimeError)  # torch's except RuntimeError catches it


def test_rendezvous_yields_a_store_rank_and_size(td, tmp_path):
    store, rank, size = next(dist.rendezvous("tcp://127.0.0.1:0?rank=0&world_size=1", timeout=5))
    t_store, t_rank, t_size = next(td.rendezvous("tcp://127.0.0.1:0?rank=0&world_size=1"))
    assert (rank, size) == (t_rank, t_size) == (0, 1)
    for s in (store, t_store):
        s.set("x", "1")
        assert s.get("x") == b"1"
    store.close()
    f_store, rank, size = next(dist.rendezvous(f"file://{tmp_path}/rdzv", rank=0, world_size=1))
    assert (rank, size) == (0, 1) and isinstance(f_store, FileStore)
    f_store.close()
    with pytest.raises(ValueError, match="is not supported; use env://"):
        next(dist.rendezvous("udp://x"))


def _append_from_threads(store, threads: int = 6, each: int = 8) -> bytes:
    """Concurrent appends of distinct tokens; returns the final value."""
    import threading

    def worker(t):
        for i in range(each):
            store.append("log", f"[{t}.{i}]")

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return store.get("log")


def _check_every_token_once(value: bytes, threads: int = 6, each: int = 8) -> None:
    tokens = value.decode().strip("[]").split("][")
    assert sorted(tokens) == sorted(f"{t}.{i}" for t in range(threads) for i in range(each))
    for t in range(threads):  # each thread's own appends stay in its order
        mine = [tok for tok in tokens if tok.startswith(f"{t}.")]
        assert mine == [f"{t}.{i}" for i in range(each)]


def test_concurrent_appends_lose_nothing_on_tcp_and_file(tmp_path):
    tcp = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=10)
    try:
        _check_every_token_once(_append_from_threads(tcp))  # compare_set loop on the wire
    finally:
        tcp.close()
    with FileStore(tmp_path / "f", timeout=10) as file_store:
        _check_every_token_once(_append_from_threads(file_store))  # under the file's lock


def test_append_and_delete_key_on_etcd():
    from shoal.elastic.rendezvous.etcd_store import EtcdStore
    from tests.support.etcd_server import EtcdServer, require_etcd

    server = EtcdServer(require_etcd()).start()
    try:
        store = EtcdStore([server.endpoint], prefix="/compat/", timeout=10)
        _check_every_token_once(_append_from_threads(store))
        assert store.delete_key("log") is True and store.delete_key("log") is False
        assert store.has_extended_api() is True
        store.close()
    finally:
        server.close()
