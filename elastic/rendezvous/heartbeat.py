"""This node's heartbeat: a value that changes every interval, written by a daemon thread."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from shoal.elastic.api import RendezvousError

logger = logging.getLogger(__name__)

__all__ = ["HeartbeatThread"]


class HeartbeatThread(threading.Thread):
    """Calls `beat()` every `interval` seconds until `stop` is set; `value` is the beat to write.

    A failed beat (a RendezvousError) is not fatal: the next one retries, and observers do not
    count time the backend was away. `value` changes before every call, so each beat is a new
    value that observers can tell from the last; a random nonce keeps a restarted process from
    repeating its predecessor's values.

    Args:
        node: this node's id (for the thread's name and the log lines).
        beat: writes `value` into the state (and does the rendezvous' housekeeping).
        interval: seconds between beats.
        stop: set to end the thread.
        aborted: true once the handler gave up on the backend; the thread then ends quietly.
    """

    def __init__(self, node: str, beat: Callable[[], None], interval: float,
                 stop: threading.Event, aborted: Callable[[], bool]):
        super().__init__(name=f"shoal-rdzv-heartbeat-{node}", daemon=True)
        self._node = node
        self._beat = beat
        self._interval = interval
        self._stop_event = stop
        self._aborted = aborted
        self._nonce = f"{os.getpid():x}.{time.time_ns() & 0xFFFFFFFF:x}"
        self._count = 0

    @property
    def value(self) -> str:
        """The heartbeat value this node's entry in the state must have now."""
        return f"{self._nonce}.{self._count}"

    def run(self) -> None:
        missed = 0
        while not self._stop_event.is_set():
            self._count += 1
            try:
                self._beat()
            except RendezvousError as exc:
                if self._aborted():
                    return
                # One warning per outage, not one per beat: a long outage would otherwise bury
                # the line that says why it happened.
                missed += 1
                level = logging.WARNING if missed == 1 else logging.DEBUG
                logger.log(level, "Node %s missed a heartbeat (%d in a row; the next ones are "
                           "only logged when they resume): %s", self._node, missed, exc)
            except Exception:
                logger.exception("Node %s's heartbeat failed unexpectedly", self._node)
            else:
                if missed:
                    logger.warning("Node %s's heartbeats resume after %d missed", self._node,
                                   missed)
                missed = 0
            self._stop_event.wait(self._interval)
