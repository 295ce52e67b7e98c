"""TCPStore basics: construction, master/worker joining, errors that name the server."""

import socket
import threading
import time

import pytest

from shoal.collectives.types import StoreError, StoreTimeout, StoreUnreachable
from shoal.collectives.store.tcp import TCPStore
from shoal.core.errors import AuthenticationError


def test_master_picks_a_port_and_a_client_reaches_it():
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as master:
        assert master.port > 0 and master.host == "127.0.0.1"
        with TCPStore("127.0.0.1", master.port, timeout=5) as client:
            client.set("k", "v")
            assert master.get("k") == b"v"


def test_master_waits_for_world_size_and_names_how_many_joined():
    with pytest.raises(StoreTimeout, match=r"waited 0.5s for 3 workers to join; only 1 joined\."):
        TCPStore("127.0.0.1", 0, world_size=3, is_master=True, timeout=0.5)


def test_master_returns_once_world_size_stores_joined():
    # The master binds port 0, so a worker can only learn the port from a master built without
    # waiting; the wait itself is exercised through the server's join counter.
    master = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=5,
                      wait_for_workers=False)
    try:
        done = threading.Event()

        def wait():
            master._wait_for_workers(2, 5.0)
            done.set()

        t = threading.Thread(target=wait)
        t.start()
        assert not done.wait(0.2)
        worker = TCPStore("127.0.0.1", master.port, timeout=5)
        t.join(5)
        assert done.is_set() and master.server.joined == 2
        worker.close()
    finally:
        master.close()


def _bound_not_listening():
    """A port that refuses connections and that nobody else can take while we hold it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


def test_client_without_server_fails_naming_the_address():
    placeholder, port = _bound_not_listening()
    with placeholder, pytest.raises(StoreError, match=rf"could not reach the server at 127\.0\.0\.1:{port} within 0\.3s"):
        TCPStore("127.0.0.1", port, timeout=0.3)


@pytest.mark.parametrize("is_master", [False, True], ids=["client", "master"])
def test_a_placeholder_secret_is_named_at_once_not_reported_as_an_unreachable_store(
        is_master, monkeypatch):
    """The store never dials with a manifest's placeholder: it says what the secret is, at once
    (a 30 s timeout is not spent retrying), and the error is no StoreUnreachable."""
    monkeypatch.setenv("SHOAL_AUTH_TOKEN", "change-me")
    placeholder, port = _bound_not_listening()
    start = time.monotonic()
    with placeholder, pytest.raises(AuthenticationError, match=(
            r"The auth token is the placeholder 'change-me' from shoal's manifests")) as info:
        TCPStore("127.0.0.1", 0 if is_master else port, is_master=is_master, timeout=30)
    assert time.monotonic() - start < 5
    assert not isinstance(info.value, StoreUnreachable)
    assert "could not reach" not in str(info.value)


def test_client_retries_until_the_server_comes_up():
    placeholder, port = _bound_not_listening()
    result = {}

    def connect():
        result["store"] = TCPStore("127.0.0.1", port, timeout=10)

    t = threading.Thread(target=connect)
    t.start()
    assert t.is_alive()
    placeholder.close()
    late = TCPStore("127.0.0.1", port, is_master=True, timeout=5)
    t.join(10)
    result["store"].set("x", "1")
    assert late.get("x") == b"1"
    result["store"].close()
    late.close()


def test_closed_store_refuses_calls():
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as store:
        pass
    with pytest.raises(StoreError, match=r"This TCPStore \(server 127\.0\.0\.1:\d+\) is closed\."):
        store.set("k", "v")


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="only the master may pass 0"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(ValueError, match="port must be an int in 0..65535, got 70000"):
        TCPStore("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="world_size must be a positive int or None, got 0"):
        TCPStore("127.0.0.1", 1, world_size=0)


def test_one_set_wakes_every_parked_waiter():
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=10) as master:
        clients = [TCPStore("127.0.0.1", master.port, timeout=10) for _ in range(16)]
        results = [None] * len(clients)

        def wait(i):
            results[i] = clients[i].get("go", timeout=10)

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while master.server.num_parked < len(clients) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert master.server.num_parked == len(clients)  # parked on the server, not polling
        master.set("go", b"now")
        for t in threads:
            t.join(10)
        assert results == [b"now"] * len(clients)
        assert master.server.num_parked == 0
        for c in clients:
            c.close()
