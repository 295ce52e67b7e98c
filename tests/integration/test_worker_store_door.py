"""The workers' store door (elastic/agent/store_door.py) against real clients: torch's C++
TCPStore client in another process, shoal's TCPStore, and peers that send garbage.

torch's client is the oracle for the protocol: every call a torch script or torch.distributed
makes on its store must answer as torch's own server answers (values, counters, waits with
timeouts, compare_set, queues, the barrier).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import struct
import subprocess
import sys
import time

import pytest

from shoal.collectives.store.tcp import TCPStore
from shoal.collectives.types import StoreTimeout
from shoal.elastic.agent.store_door import SNIFF_S, WorkerStoreDoor
from tests.support.requirements import missing

TOKEN = "door-test-" + "k" * 32

# Each torch rank runs the calls a torch job makes, in a fresh process (torch's client is C++).
TORCH_CLIENT = r'''
import json, sys
from datetime import timedelta
import torch.distributed as dist
port, rank = int(sys.argv[1]), int(sys.argv[2])
s = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=20))
out = {}
s.set(f"hello{rank}", f"from {rank}")
s.wait(["hello0", "hello1"])
out["peer"] = s.get(f"hello{1 - rank}").decode()
out["added"] = s.add("counter", 5)
s.barrier("both-added", 2)
out["counter"] = int(s.get("counter"))
out["check"] = [s.check(["hello0"]), s.check(["nobody"])]
out["created"] = s.compare_set(f"cas{rank}", "", "new").decode()
out["swapped"] = s.compare_set(f"cas{rank}", "new", "newer").decode()
out["kept"] = s.compare_set(f"cas{rank}", "wrong", "x").decode()
out["deleted"] = [s.delete_key(f"cas{rank}"), s.delete_key("never-set")]
s.multi_set([f"m{rank}"], ["a"])
s.append(f"m{rank}", "b")
out["multi"] = [v.decode() for v in s.multi_get([f"m{rank}", "hello0"])]
s.queue_push(f"q{rank}", b"job")
out["queue"] = [s.queue_len(f"q{rank}"), s.queue_pop(f"q{rank}").decode(), s.queue_len(f"q{rank}")]
try:
    s.wait(["never"], timedelta(seconds=0.3))
    out["timeout"] = "no"
except Exception as exc:
    out["timeout"] = type(exc).__name__
s.set(f"after-timeout{rank}", "ok")  # the connection still works after a cancelled wait
out["after"] = s.get(f"after-timeout{rank}").decode()
out["num_keys"] = s.num_keys() >= 4
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.fixture
def door():
    d = WorkerStoreDoor("127.0.0.1", TOKEN)
    yield d
    d.close()


def _torch_ranks(port: int) -> list[dict]:
    if importlib.util.find_spec("torch") is None:
        missing("the torch store tests", "torch is not installed (pip install torch==2.13.0)")
    procs = [subprocess.Popen([sys.executable, "-c", TORCH_CLIENT, str(port), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, f"rank {rank}: {err[-3000:]}"
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


def test_torch_clients_get_torchs_answers(door):
    results = _torch_ranks(door.port)
    for rank, out in enumerate(results):
        assert out["peer"] == f"from {1 - rank}"
        assert out["counter"] == 10  # both ranks added 5 before the barrier let either through
        assert out["check"] == [True, False]
        assert (out["created"], out["swapped"], out["kept"]) == ("new", "newer", "newer")
        assert out["deleted"] == [True, False]
        assert out["multi"] == ["ab", "from 0"]
        assert out["queue"] == [1, "job", 0]
        assert out["timeout"] == "DistStoreError"
        assert out["after"] == "ok"
        assert out["num_keys"]
    assert sorted(r["added"] for r in results) == [5, 10]


def test_shoal_clients_are_relayed_to_the_authenticated_store(door):
    first = TCPStore("127.0.0.1", door.port, timeout=10, token=TOKEN)
    second = TCPStore("127.0.0.1", door.port, timeout=10, token=TOKEN)
    try:
        first.set("k", "v")
        assert second.get("k", 5) == b"v"
        assert second.add("n", 3) == 3
        with pytest.raises(StoreTimeout):
            second.wait(["never"], 0.3)
    finally:
        first.close()
        second.close()


def test_a_shoal_client_with_another_secret_is_refused_end_to_end(door):
    with pytest.raises(Exception, match="secret"):
        TCPStore("127.0.0.1", door.port, timeout=3, token="another-" + "z" * 32)


def _send_and_see_closed(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        sock.settimeout(5)
        assert sock.recv(64) == b"", "the door should have dropped this peer"


@pytest.mark.parametrize("garbage", [
    b"\xffGET / HTTP/1.1\r\n\r\n",  # a first byte that is not torch's VALIDATE
    b"\x00" + struct.pack("<I", 0xDEADBEEF),  # VALIDATE with a wrong magic number
    b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x03" + struct.pack("<Q", 1 << 40),  # huge key
    b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x63",  # an unknown command
], ids=["http", "wrong-magic", "huge-key", "unknown-command"])
def test_garbage_ends_that_connection_and_the_door_keeps_serving(door, garbage):
    _send_and_see_closed(door.port, garbage)
    store = TCPStore("127.0.0.1", door.port, timeout=10, token=TOKEN)
    try:
        store.set("still", "serving")
        assert store.get("still", 5) == b"serving"
    finally:
        store.close()


def test_a_silent_stranger_does_not_hold_up_other_clients(door):
    with socket.create_connection(("127.0.0.1", door.port), timeout=5):
        started = time.monotonic()
        store = TCPStore("127.0.0.1", door.port, timeout=10, token=TOKEN)
        try:
            store.set("a", "b")
        finally:
            store.close()
        # The sniff window once, plus a handshake: never the stranger's own wait.
        assert time.monotonic() - started < SNIFF_S + 2.0
