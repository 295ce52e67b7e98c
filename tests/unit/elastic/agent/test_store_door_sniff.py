"""How long the workers' store door waits before it takes a silent client for shoal's: the
whole SNIFF_S in a job's first round, RESTART_SNIFF_S in a round after one that met only shoal
clients (the same script restarted), SNIFF_S again once a torch client came. The door's
account of what it met is checked with a real shoal TCPStore client and torch's own VALIDATE
bytes on a socket."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from shoal.collectives.store.tcp import TCPStore
from shoal.elastic.agent.round_setup import next_sniff
from shoal.elastic.agent.store_door import RESTART_SNIFF_S, SNIFF_S, WorkerStoreDoor
from shoal.elastic.agent.torch_store import VALIDATION_MAGIC

TOKEN = "sniff-test-" + "k" * 32


@pytest.mark.parametrize("met_torch, relayed, current, expected", [
    (False, 2, SNIFF_S, RESTART_SNIFF_S),          # only shoal clients: the same script again
    (True, 2, RESTART_SNIFF_S, SNIFF_S),           # a torch client came: the full window
    (True, 0, SNIFF_S, SNIFF_S),
    (False, 0, RESTART_SNIFF_S, RESTART_SNIFF_S),  # nobody came (died first): nothing learned
    (False, 0, SNIFF_S, SNIFF_S),
])
def test_the_next_window_follows_what_the_door_met(met_torch, relayed, current, expected):
    assert next_sniff(met_torch, relayed, current) == expected


def test_the_door_counts_shoal_clients_and_notices_a_torch_client():
    door = WorkerStoreDoor("127.0.0.1", TOKEN, RESTART_SNIFF_S)
    try:
        store = TCPStore("127.0.0.1", door.port, timeout=10, token=TOKEN)
        try:
            store.set("k", "v")
            assert store.get("k", 5) == b"v"
        finally:
            store.close()
        assert door.relayed == 1 and not door.met_torch
        with socket.create_connection(("127.0.0.1", door.port), timeout=5) as sock:
            sock.sendall(b"\x00" + struct.pack("<I", VALIDATION_MAGIC))  # torch's VALIDATE
            end = time.monotonic() + 5
            while not door.met_torch and time.monotonic() < end:
                time.sleep(0.005)
        assert door.met_torch and door.relayed == 1
    finally:
        door.close()
