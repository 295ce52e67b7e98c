"""Socket buffers of the tcp backend's links: fixed between ranks of one host, the receive
side autotuned by the kernel between hosts (collectives/backends/tcp/wire.py `tune_socket`).

The cross-host half runs across real network namespaces in tests/integration/test_multihost.py
(the catalogue reports every link's receive buffer); here the rule itself and the same-host
half, on real sockets.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest

from shoal.collectives.backends.tcp import wire
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.constants import SOCKET_BUFFER_BYTES
from shoal.collectives.store.hash import HashStore
from tests.support.threaded_ranks import form_groups

# Linux reports twice what was asked for (the kernel's bookkeeping share).
FIXED = 2 * SOCKET_BUFFER_BYTES


@pytest.mark.parametrize("address, own, same", [
    ("127.0.0.1", "10.213.47.2", True),
    ("127.0.1.1", "10.213.47.2", True),  # Debian's /etc/hosts name for the machine
    ("::1", "10.213.47.2", True),
    ("10.213.47.2", "10.213.47.2", True),  # our own address: the kernel loops it back
    ("10.213.47.3", "10.213.47.2", False),
    ("fe80::1", "10.213.47.2", False),
    ("not an address", "10.213.47.2", False),
])
def test_same_host_is_loopback_or_our_own_address(address, own, same):
    assert wire.is_same_host_address(address, own) is same


def _buffers(sock: socket.socket) -> tuple[int, int]:
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


def test_tune_socket_fixes_the_receive_buffer_only_within_a_host():
    with socket.socket() as same, socket.socket() as other, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        untouched = _buffers(other)[1]
        wire.tune_socket(same, same_host=True)
        wire.tune_socket(other, same_host=False)
        wire.tune_socket(unix, same_host=False)  # a Unix socket is on this host whatever it says
        assert _buffers(same) == (FIXED, FIXED)
        assert _buffers(unix) == (FIXED, FIXED)
        assert _buffers(other) == (FIXED, untouched)
        assert untouched != FIXED  # else the check above could not tell the two apart


@pytest.mark.parametrize("transport, link", [("tcp", "tcp"), ("shm", "unix")])
def test_links_within_a_host_keep_fixed_buffers_on_both_ends(transport, link, monkeypatch):
    """Every data socket of a one-host group, dialled or accepted, has both buffers fixed:
    on loopback TCP (small buffers win on the kernel's loopback path; bench/allreduce.py
    --tcp-too) and on Unix sockets (an accepted one inherits nothing from its listener)."""
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", transport)
    store, world = HashStore(), 3
    pgs = form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=20.0))
    try:
        for rank, pg in enumerate(pgs):
            mesh = pg._mesh
            for peer in range(world):
                if peer == rank:
                    continue
                assert mesh.transports[peer] == link
                assert mesh.remote[peer] is False
                for end in (mesh.tx[peer], mesh.rx[peer]):
                    assert _buffers(end.sock) == (FIXED, FIXED), (rank, peer, end.sock)
    finally:
        for pg in pgs:
            pg.shutdown()


_OWN_ADDRESS_GROUP = """
import socket
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
from tests.support.threaded_ranks import form_groups

store, world = HashStore(), 3
pgs = form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=20.0))
for rank, pg in enumerate(pgs):
    mesh = pg._mesh
    for peer in range(world):
        if peer != rank:
            for end in (mesh.tx[peer], mesh.rx[peer]):
                print(mesh.host, mesh.transports[peer], mesh.remote[peer],
                      end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                      end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
for pg in pgs:
    pg.shutdown()
"""


def test_tcp_links_to_our_own_routable_address_keep_fixed_buffers():
    """Ranks bound to a routable address of their host (as on a multi-host job) that talk TCP
    to each other (SHOAL_LOCAL_TRANSPORT=tcp): the listener cannot know who will dial it, so
    its receive buffer is left to autotuning; `_place` fixes it for a peer at our own
    address, and the dialler fixes its own. Run on a network-namespace host's eth0 address."""
    from tests.support.netns import Hosts, require_netns

    require_netns()
    with Hosts(1) as hosts:
        host = hosts[0]
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "SHOAL_LOCAL_TRANSPORT": "tcp",
               "SHOAL_COLLECTIVES_HOST": host.address}
        done = host.run([sys.executable, "-c", _OWN_ADDRESS_GROUP], timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")[:-1]
    assert len(lines) == 12, done.stdout  # 3 ranks x 2 peers x (send, receive) sockets
    assert set(lines) == {f"{host.address} tcp False {FIXED} {FIXED}"}, done.stdout


def _links_over(remote, members=None):
    """Links with only what `reaches_another_host` reads: the mesh's verdict per group rank
    and the links' renumbering."""
    from types import SimpleNamespace

    from shoal.collectives.backends.tcp.links import Links

    links = Links.__new__(Links)
    links.mesh = SimpleNamespace(remote=list(remote))
    links.members = None if members is None else tuple(members)
    return links


def test_a_ring_reaches_another_host_when_a_peer_is_remote():
    """all_reduce's large ring takes the sender thread only when neither of its peers is on
    another host (over_sockets.all_reduce; constants.THREADED_MIN_BYTES says why), as the mesh
    decided when it made the links; a subset's peers are its own ranks, renumbered."""
    remote = [False, False, True, True]  # rank 0's view of hosts [0, 1 | 2, 3]
    group = _links_over(remote)
    assert group.reaches_another_host([1]) is False
    assert group.reaches_another_host([1, 3]) is True
    assert group.reaches_another_host([]) is False
    cross = _links_over(remote, members=[0, 2])  # a ring across hosts: its rank 1 is rank 2
    assert cross.reaches_another_host([1]) is True
    local = _links_over(remote, members=[1, 0])  # the host's ranks, in another order
    assert local.reaches_another_host([0, 1]) is False

