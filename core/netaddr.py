"""Which local address other machines reach this one at, and whether an address is this host's.

`/etc/hosts` on Debian-like systems maps the machine's own name to 127.0.1.1, so resolving the
hostname (what `socket.getfqdn()` gives) advertises loopback to peers on other hosts. The
address that routes to a peer is the one the kernel picks as the source of a connection to it:
a connected UDP socket reveals it without sending a packet.
"""

from __future__ import annotations

import errno
import socket
from typing import Optional

# Any port will do: connecting a UDP socket only looks up the route.
_PROBE_PORT = 9


def address_towards(peer_host: str) -> Optional[str]:
    """The local address this host uses to reach `peer_host`, or None when there is no route
    (or the name does not resolve)."""
    try:
        infos = socket.getaddrinfo(peer_host, _PROBE_PORT, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)
                return probe.getsockname()[0]
        except OSError:
            continue
    return None


def is_local_address(host: str) -> bool:
    """True when `host` (an address or a name) is an address of this host: one a listener can
    bind. Wildcards ("", "0.0.0.0", "::") count as local."""
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, socktype, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, socktype, proto) as probe:
                probe.bind(sockaddr)
                return True
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                return True  # bindable address, only this probe failed (e.g. a permission)
    return False
