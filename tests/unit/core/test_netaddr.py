"""core.netaddr: the address that routes to a peer, and whether an address is this host's."""

from __future__ import annotations

import sys

from shoal.core.netaddr import address_towards, is_local_address
from tests.support.netns import Hosts, require_netns


def test_loopback_routes_to_loopback_and_is_local():
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") in ("127.0.0.1", "::1")
    assert is_local_address("127.0.0.1")
    assert is_local_address("0.0.0.0")


def test_an_address_of_another_host_is_not_local_and_a_bad_name_has_no_route():
    assert not is_local_address("192.0.2.77")  # TEST-NET-1: never assigned to a machine
    assert address_towards("no-such-host.invalid") is None
    assert not is_local_address("no-such-host.invalid")


PROBE = """
import sys
from shoal.core.netaddr import address_towards, is_local_address
print(address_towards(sys.argv[1]), is_local_address(sys.argv[2]), is_local_address(sys.argv[1]))
"""


def test_on_a_host_the_route_to_a_peer_leaves_from_its_own_address_not_loopback():
    require_netns()
    with Hosts(2) as hosts:
        a, b = hosts[0], hosts[1]
        out = a.run([sys.executable, "-c", PROBE, b.address, a.address])
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [a.address, "True", "False"]
