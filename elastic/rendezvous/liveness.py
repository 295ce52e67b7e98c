"""Which nodes' heartbeats lapsed, as one observer sees them on its own clock.

Every node writes a heartbeat counter into the rendezvous state each `heartbeat_interval`.
An observer times how long each node's value stays unchanged on its own monotonic clock, so
the nodes' clocks need not agree; a value unchanged for `heartbeat_timeout` means the node is
dead. Time while the backend was unreachable does not count: nobody could write heartbeats
then, so an outage of the backend kills no node.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from shoal.elastic.rendezvous.state import RendezvousState

__all__ = ["LivenessTracker"]


class LivenessTracker:
    """Times every node's heartbeat value from the states this node reads; thread-safe.

    Args:
        node: this node, never reported as lapsed.
        heartbeat_timeout: seconds a value may stay unchanged before its node counts as dead.
    """

    def __init__(self, node: str, heartbeat_timeout: float):
        self._node = node
        self._timeout = heartbeat_timeout
        self._lock = threading.Lock()
        # node -> (last heartbeat value seen, monotonic time it was first seen)
        self._seen: dict[str, tuple[Optional[str], float]] = {}
        self._backend_down = False
        self._last_read: Optional[float] = None

    def backend_unreachable(self) -> None:
        """A call to the backend failed: the next observation restarts every clock."""
        with self._lock:
            self._backend_down = True

    def observe(self, state: Optional[RendezvousState]) -> None:
        """Record a state just read (None: there is none)."""
        now = time.monotonic()
        with self._lock:
            # Reads more than half a timeout apart mean the backend kept this node waiting
            # (retried inside the backend until it came back): count that as an outage too.
            blind = self._last_read is not None and now - self._last_read > self._timeout / 2
            if self._backend_down or blind:
                self._backend_down = False
                self._seen = {n: (v, now) for n, (v, _) in self._seen.items()}
            self._last_read = now
            if state is None:
                return
            nodes = {*state.heartbeats, *state.participants, *state.wait_list, *state.expected}
            seen = {}
            for node in nodes:
                value = state.heartbeats.get(node)
                old = self._seen.get(node)
                seen[node] = old if old is not None and old[0] == value else (value, now)
            self._seen = seen

    def lapsed(self) -> dict[str, float]:
        """Other nodes whose value stood still longer than heartbeat_timeout -> for how long."""
        now = time.monotonic()
        with self._lock:
            ages = {n: now - since for n, (_, since) in self._seen.items() if n != self._node}
        return {n: age for n, age in ages.items() if age > self._timeout}
