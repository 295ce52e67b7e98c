"""Notice, within seconds, that the node hosting the run's rendezvous store is gone.

A node that is a *client* of the embedded store (every node but its host) cannot go on
without it: the rendezvous state, the restart count and the exit barrier all live there. Left
alone, every store call fails on its own, each caller retries up to its own timeout, and the
agent ends only when the join timeout (10 minutes by default) runs out, with a warning per
retry and no word about why. `StoreHostWatch` probes the store on its own short-timeout
connection once per heartbeat interval; when the probes fail without a break for
`heartbeat_timeout` seconds (the same rule that declares a node dead), it declares the host
lost once and calls `on_lost` with a `StoreHostLostError` naming the host node and its address.

The host writes its node id under `STORE_HOST_KEY` when it starts serving (`announce_host`);
the watch reads it on a successful probe, so the message can name the node after it died.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from shoal.collectives.store.api import Store
from shoal.elastic.api import StoreHostLostError

logger = logging.getLogger(__name__)

__all__ = ["STORE_HOST_KEY", "StoreHostWatch", "announce_host"]

STORE_HOST_KEY = "shoal/store_host"
# A probe needs at least this many failures in a row as well as the time: one refused
# connection during a busy moment is not a lost host.
MIN_FAILED_PROBES = 3


def announce_host(store: Store, node_id: str) -> None:
    """The store's host says who it is, so that clients can name it if it dies."""
    store.set(STORE_HOST_KEY, node_id)


class StoreHostWatch:
    """Probe a remote store; call `on_lost(error)` once when it stopped answering for good.

    Args:
        probe_store: a client of the store with a short timeout of its own (a probe blocked on
            a hung host must not outlast `lost_after`); the watch owns and closes it.
        address: "host:port" of the store, for the message.
        interval: seconds between probes (the heartbeat interval).
        lost_after: seconds of failed probes, without one success, that mean the host is gone.
        on_lost: called once, from the watch's thread, with the error.
    """

    def __init__(self, probe_store: Store, address: str, *, interval: float, lost_after: float,
                 on_lost: Callable[[StoreHostLostError], None]):
        if not interval > 0 or not lost_after > 0:
            raise ValueError(f"StoreHostWatch needs interval and lost_after > 0 seconds, got "
                             f"{interval!r} and {lost_after!r}.")
        self._store = probe_store
        self.address = address
        self._interval = interval
        self._lost_after = lost_after
        self._on_lost = on_lost
        self.host_node: Optional[str] = None
        self.error: Optional[StoreHostLostError] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shoal-store-host-watch",
                                        daemon=True)

    def start(self) -> "StoreHostWatch":
        """Start probing in a daemon thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop probing (waits at most one probe) and close the probe's connection."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._interval + self._lost_after + 1.0)
        try:
            self._store.close()
        except Exception as exc:  # noqa: BLE001  (closing must not raise)
            logger.debug("Closing the store probe failed: %s", exc)

    @property
    def lost(self) -> bool:
        """True once the host was declared lost."""
        return self.error is not None

    def probe_once(self) -> None:
        """One probe; raises whatever the store raises. Learns the host's node id on the way."""
        if self._store.check([STORE_HOST_KEY]) and self.host_node is None:
            self.host_node = self._store.get(STORE_HOST_KEY, self._lost_after).decode(
                errors="replace")

    def _loop(self) -> None:
        failing_since: Optional[float] = None
        failures = 0
        while not self._stop.is_set():
            try:
                self.probe_once()
            except Exception as exc:  # noqa: BLE001  (every failure to answer counts)
                now = time.monotonic()
                failures += 1
                if failing_since is None:
                    failing_since = now
                    # One line when it starts; the verdict (or the recovery) says the rest.
                    logger.warning("The rendezvous store at %s does not answer (%s); declaring "
                                   "its host lost if that lasts %gs", self.address, exc,
                                   self._lost_after)
                if failures >= MIN_FAILED_PROBES and now - failing_since >= self._lost_after:
                    self._declare_lost(now - failing_since, failures, exc)
                    return
            else:
                if failing_since is not None:
                    logger.warning("The rendezvous store at %s answers again after %.1fs "
                                   "(%d failed probe(s))", self.address,
                                   time.monotonic() - failing_since, failures)
                failing_since, failures = None, 0
            self._stop.wait(self._interval)

    def _declare_lost(self, silent_for: float, failures: int, last: BaseException) -> None:
        node = f" node {self.host_node}" if self.host_node else ""
        self.error = StoreHostLostError(
            f"The rendezvous cannot go on: the store host{node} at {self.address} is gone (its "
            f"store refused or ignored {failures} probes over {silent_for:.1f}s; last error: "
            f"{last})."
        )
        logger.error("%s", self.error)
        try:
            self._on_lost(self.error)
        except Exception:
            logger.exception("Reacting to the lost store host failed")
