"""The multi-host harness itself (tests/support/netns.py): hosts reach each other over the
bridge, not each other's loopback; etcd serves on a host's address; a cut host is gone; and
nothing the harness made outlives it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.netns import Hosts, require_link_shaping, require_netns
from tests.support.shoal_run import pid_alive

pytestmark = pytest.mark.usefixtures("netns")

ECHO_SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.sendall(conn.recv(64).upper())
"""

CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as s:
        s.sendall(b"hello")
        print(s.recv(64).decode())
except OSError as exc:
    print(type(exc).__name__)
"""

CONNECT_ONLY = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
print("connected")
"""


@pytest.fixture
def netns():
    require_netns()


def _netns_names() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_hosts_reach_each_other_over_the_bridge_and_leave_nothing_behind():
    before = _netns_names()
    with Hosts(2) as hosts:
        a, b = hosts[0], hosts[1]
        server = a.popen([sys.executable, "-c", ECHO_SERVER, a.address],
                         stdout=subprocess.PIPE, text=True)
        port = int(server.stdout.readline())
        assert b.run([sys.executable, "-c", CONNECT, a.address, str(port)]).stdout.strip() == "HELLO"
        # b's loopback is b's own: a's listener is not there.
        assert b.run([sys.executable, "-c", CONNECT, "127.0.0.1", str(port)]).stdout.strip() \
            == "ConnectionRefusedError"
        assert len(_netns_names() - before) == 3  # two hosts and the switch
        hosts.cut(a)
        assert server.poll() is not None
        assert b.run([sys.executable, "-c", CONNECT, a.address, str(port)]).stdout.strip() in (
            "TimeoutError", "OSError", "ConnectionRefusedError")
    assert _netns_names() == before


def test_etcd_serves_on_a_hosts_address():
    with Hosts(2) as hosts:
        etcd = EtcdServer(host=hosts[0].address, command_prefix=hosts[0].command([]))
        try:
            etcd.start()
            host, port = etcd.endpoint.split(":")
            assert host == hosts[0].address
            probe = hosts[1].run([sys.executable, "-c", CONNECT_ONLY, host, port])
            assert probe.stdout.strip() == "connected", probe.stderr
        finally:
            etcd.close()


def test_links_take_the_mtu_asked_for_and_bad_values_are_refused():
    with Hosts(1, mtu=65535) as hosts:
        shown = hosts[0].run(["ip", "-o", "link", "show", "eth0"]).stdout
        assert " mtu 65535 " in shown, shown
    with Hosts(1) as hosts:  # the kernel's default: plain Ethernet
        assert " mtu 1500 " in hosts[0].run(["ip", "-o", "link", "show", "eth0"]).stdout
    with pytest.raises(ValueError, match="Hosts' mtu must be within 68 and 65535 bytes, got 70000"):
        Hosts(1, mtu=70000)
    with pytest.raises(ValueError, match="Hosts' link_gbit must be within 0.01 and 400 "
                                         "Gbit/s, got 0"):
        Hosts(1, link_gbit=0)


SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
left = int(sys.argv[2])
while left:
    left -= len(conn.recv(min(left, 1 << 20)))
conn.sendall(b"done")
"""

SOURCE = """
import socket, sys, time
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    s.settimeout(30)
    start = time.monotonic()
    s.sendall(bytes(int(sys.argv[3])))
    assert s.recv(4) == b"done"
    print(time.monotonic() - start)
"""


def test_a_shaped_link_carries_no_more_than_its_rate_each_way():
    """link_gbit puts tbf on both ends of every host's link; 2 MiB at 20 Mbit/s take 0.88 s
    in Ethernet frames (0.82 s after the shaper's 128 KiB burst), where the unshaped link takes
    milliseconds; and not several times that (a shaper set in bytes, not bits)."""
    require_link_shaping()
    size = 2 << 20
    with Hosts(2, link_gbit=0.02) as hosts:
        a, b = hosts[0], hosts[1]
        for host in (a, b):  # out of the host on its eth0, into it on the switch's port
            assert " tbf " in host.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
            into = subprocess.run(["tc", "-n", hosts.switch, "qdisc", "show", "dev",
                                   host.switch_port], capture_output=True, text=True, timeout=10)
            assert " tbf " in into.stdout, into.stdout + into.stderr
        for sender, receiver in ((a, b), (b, a)):
            sink = receiver.popen([sys.executable, "-c", SINK, receiver.address, str(size)],
                                  stdout=subprocess.PIPE, text=True)
            port = sink.stdout.readline().strip()
            sent = sender.run([sys.executable, "-c", SOURCE, receiver.address, port, str(size)])
            assert sent.returncode == 0, sent.stderr
            assert 0.7 <= float(sent.stdout) < 3.0, sent.stdout
            sink.wait(10)


SLEEPER = "import time; print('up', flush=True); time.sleep(120)"


def test_a_failing_test_body_still_leaves_nothing_behind():
    before = _netns_names()
    sleeper = None
    with pytest.raises(RuntimeError, match="the test body failed"):
        with Hosts(2) as hosts:
            sleeper = hosts[1].popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE,
                                     text=True)
            assert sleeper.stdout.readline().strip() == "up"
            raise RuntimeError("the test body failed")
    assert sleeper.wait(10) is not None  # killed by the cleanup, not left running
    assert _netns_names() == before


MAKER = """
import subprocess, sys, time
from tests.support.netns import Hosts
hosts = Hosts(2).__enter__()
proc = hosts[0].popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(" ".join([hosts.switch] + [h.netns for h in hosts.hosts]), proc.pid, flush=True)
time.sleep(120)
"""


def test_namespaces_of_a_killed_test_run_are_removed_by_the_next_one():
    """A test process SIGKILLed before its cleanup (a CI timeout) leaves its namespaces and the
    processes in them; the next `Hosts` removes them."""
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        names, orphan = maker.stdout.readline().rsplit(" ", 1)
    finally:
        maker.kill()
        maker.wait(10)
    left = set(names.split())
    assert len(left) == 3 and left <= _netns_names()
    with Hosts(1):
        assert not (left & _netns_names())
    deadline = time.monotonic() + 10
    while pid_alive(int(orphan)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(int(orphan)), "a process in a stale namespace outlived its removal"

