"""Read the rendezvous for the agent's monitor loop, in a thread of its own.

The monitor loop must react to its workers at once: when they all succeed or one fails, the
agent's next steps (the exit barrier, the failure record) have their own bounds. If the loop
read the rendezvous itself, one read stuck on an unreachable etcd (up to the store timeout,
30 s by default) would hold a finished or failed node for that long. So the reads happen here
and the loop only looks at the latest result.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Optional

from shoal.elastic.api import RendezvousError

logger = logging.getLogger(__name__)

# Waiting nodes only matter for scaling up: look at most this often.
WAITING_CHECK_S = 1.0


@dataclasses.dataclass(frozen=True)
class Poll:
    """One reading: why the round must end (or None), how many nodes wait, or the error."""

    seq: int
    reason: Optional[str] = None
    waiting: int = 0
    error: Optional[RendezvousError] = None


class RoundPoller:
    """Poll `handler.restart_requested()` (and `num_nodes_waiting()`) every `interval`; set
    `wake` when a reading needs the agent's attention."""

    def __init__(self, handler, interval: float, wake: threading.Event):
        self._handler = handler
        self._interval = interval
        self._wake = wake
        self._stop = threading.Event()
        self._latest: Optional[Poll] = None
        self._thread = threading.Thread(target=self._loop, name="shoal-agent-round-poll",
                                        daemon=True)

    def start(self) -> "RoundPoller":
        """Start polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; a read in progress is abandoned (the thread is a daemon)."""
        self._stop.set()

    def latest(self) -> Optional[Poll]:
        """The newest reading, or None before the first one."""
        return self._latest

    def _loop(self) -> None:
        seq = 0
        next_waiting = 0.0
        while not self._stop.is_set():
            seq += 1
            try:
                reason = self._handler.restart_requested()
                waiting = 0
                now = time.monotonic()
                if reason is None and now >= next_waiting:
                    next_waiting = now + max(WAITING_CHECK_S, self._interval)
                    waiting = self._handler.num_nodes_waiting()
                poll = Poll(seq, reason, waiting)
            except RendezvousError as exc:
                poll = Poll(seq, error=exc)
            except Exception as exc:
                logger.exception("Reading the rendezvous failed unexpectedly")
                poll = Poll(seq, error=RendezvousError(f"reading the rendezvous failed: {exc}"))
            if self._stop.is_set():
                return
            self._latest = poll
            if poll.reason is not None or poll.waiting or poll.error is not None:
                self._wake.set()
            self._stop.wait(self._interval)
