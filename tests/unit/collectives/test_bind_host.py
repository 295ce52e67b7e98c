"""Which address a rank listens on and advertises (collectives.env.bind_host): never loopback
when its peers are on other hosts, and a sentence instead of a late connection failure when the
configured address or the route is wrong."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from shoal.collectives import DistNetworkError
from shoal.collectives.env import bind_host
from tests.support.requirements import missing


def test_a_master_on_this_host_binds_loopback(monkeypatch):
    monkeypatch.delenv("SHOAL_COLLECTIVES_HOST", raising=False)
    assert bind_host(None) == "127.0.0.1"
    assert bind_host("127.0.0.1") == "127.0.0.1"
    assert bind_host("localhost") == "127.0.0.1"


def test_an_explicit_address_of_this_host_wins(monkeypatch):
    monkeypatch.setenv("SHOAL_COLLECTIVES_HOST", "127.0.0.1")
    assert bind_host("192.0.2.7") == "127.0.0.1"


def test_an_explicit_address_of_another_host_is_refused_with_a_sentence(monkeypatch):
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    monkeypatch.setenv("SHOAL_COLLECTIVES_HOST", "192.0.2.7")
    with pytest.raises(DistNetworkError, match=r"SHOAL_COLLECTIVES_HOST='192\.0\.2\.7' is not an "
                                               r"address of this host, so this rank cannot "
                                               r"listen on it"):
        bind_host("127.0.0.1")
    # A DistNetworkError is a RuntimeError, as torch's is.
    assert issubclass(DistNetworkError, RuntimeError)


_NO_ROUTE_PROBE = """
from shoal.collectives import DistNetworkError
from shoal.collectives.env import bind_host
try:
    print("bound", bind_host("10.77.0.1"))
except DistNetworkError as exc:
    print("refused", exc)
"""


def test_no_route_to_a_remote_master_is_refused_instead_of_advertising_loopback():
    """In a network namespace of its own (only a loopback device, no route anywhere), a rank
    whose master is remote has no address peers could reach: it must say so, not bind 127.0.0.1."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        missing("the no-route test", "needs root and util-linux's unshare for a network namespace")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("SHOAL_COLLECTIVES_HOST", None)
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", _NO_ROUTE_PROBE],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused This host has no route to the master address "
                                  "'10.77.0.1', so ranks on other hosts could not reach this one"), \
        done.stdout + done.stderr
