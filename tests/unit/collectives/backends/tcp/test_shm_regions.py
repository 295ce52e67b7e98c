"""The shared-memory regions of the tcp backend: the checks that keep a peer from hurting us
(seals, sizes, read-only mappings, garbled or missing offers). The collectives that run over
them, with ranks as threads, are in tests/multiproc/test_tcp_shared_memory.py."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from shoal.collectives.backends.tcp import framing, shm
from shoal.core import channel


def test_an_unsealed_region_is_refused():
    fd = os.memfd_create("test-unsealed", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(ValueError, match="not sealed against shrinking"):
            shm._map_peer_region(fd, 4096)
    finally:
        os.close(fd)


def test_a_region_smaller_than_offered_is_refused():
    fd = os.memfd_create("test-small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(ValueError, match="has 4096 bytes, fewer than the 8192 offered"):
            shm._map_peer_region(fd, 8192)
    finally:
        os.close(fd)


def test_own_region_is_sealed_and_peers_map_it_read_only():
    fd = shm._create_region(8192)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(OSError):
            os.ftruncate(fd, 100)  # sealed: nobody can shrink it under a reader
        view = shm._map_peer_region(fd, 8192)
        with pytest.raises(TypeError):
            view[0] = 1  # read-only mapping: a rank writes only its own region
        view.close()
    finally:
        os.close(fd)


def _one_way(secret: bytes = b"s" * 32):
    """A connection from a sender to a receiver, as the mesh makes them: (Outbound, Inbound)."""
    send_sock, recv_sock = socket.socketpair(socket.AF_UNIX)
    nonces = (os.urandom(32), os.urandom(32))
    client = channel.pair(secret, "collectives", *nonces, server=False)
    server = channel.pair(secret, "collectives", *nonces, server=True)
    return framing.Outbound(send_sock, client), framing.Inbound(recv_sock, server)


def _links():
    """Rank 0's ends of its two connections with rank 1, and rank 1's."""
    a_tx, b_rx = _one_way()
    b_tx, a_rx = _one_way()
    return (a_tx, a_rx), (b_tx, b_rx)


def _close(*ends):
    for end in ends:
        end.sock.close()


def test_a_garbled_offer_is_a_setup_error():
    (a_tx, a_rx), (b_tx, b_rx) = _links()
    try:
        b_tx.send_header((b"GARBAGE!" * 4)[:shm._OFFER.size])
        with pytest.raises(shm.ShmSetupError, match="rank 1: sent b'GARBAGE!GARBAGE!GARBAGE!GARBA' where a shared-memory offer belongs"):
            shm.SharedSlots.establish(0, 2, [None, a_tx], [None, a_rx], 4096, timeout=2.0)
    finally:
        _close(a_tx, b_rx, b_tx, a_rx)


def test_an_offer_without_the_connections_tag_is_a_setup_error():
    (a_tx, a_rx), (b_tx, b_rx) = _links()
    try:
        # What a relay could send: a well-formed offer, with a tag it cannot compute.
        b_tx.sock.sendall(shm._OFFER.pack(shm._OFFER_MAGIC, 0, 3 * 4096, 0, 0) + bytes(16))
        with pytest.raises(shm.ShmSetupError, match="rank 1: sent a shared-memory offer that failed its integrity check"):
            shm.SharedSlots.establish(0, 2, [None, a_tx], [None, a_rx], 4096, timeout=2.0)
    finally:
        _close(a_tx, b_rx, b_tx, a_rx)


def test_a_descriptor_other_than_the_offered_memfd_is_refused():
    own = shm._create_region(8192)
    other = shm._create_region(8192)
    try:
        with pytest.raises(ValueError, match="not the memfd it names"):
            shm._map_peer_region(other, 8192, shm._identity(own))
        shm._map_peer_region(own, 8192, shm._identity(own)).close()
    finally:
        os.close(own)
        os.close(other)


def test_a_silent_peer_is_a_setup_error_within_the_timeout():
    (a_tx, a_rx), (b_tx, b_rx) = _links()
    try:
        with pytest.raises(shm.ShmSetupError, match="rank 1: did not answer the shared-memory setup within 0.5s"):
            shm.SharedSlots.establish(0, 2, [None, a_tx], [None, a_rx], 4096, timeout=0.5)
    finally:
        _close(a_tx, b_rx, b_tx, a_rx)
