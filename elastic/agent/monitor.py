"""Worker monitoring: wait, in a running round, for the next thing the agent must act on.

Worker exits and notable readings of the rendezvous (`round_poll`) wake the watch at once; a
rendezvous that cannot be read is reported once and the workers go on while it retries.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import Callable, Optional

from shoal.elastic.agent.round_poll import RoundPoller
from shoal.elastic.agent.workers import WorkerGroup
from shoal.elastic.api import RendezvousError, StoreHostLostError
from shoal.elastic.rendezvous.sealing import ForgedValueError

logger = logging.getLogger(__name__)


class EventKind(enum.Enum):
    """What happened in the round."""

    INTERRUPTED = "interrupted"  # a signal reached the agent
    HOST_LOST = "host_lost"      # the run's store went with its host
    FORGED = "forged"            # the rendezvous holds a value that fails the job's MAC
    FAILED = "failed"            # a local worker failed
    SUCCEEDED = "succeeded"      # every local worker succeeded
    WAITING = "waiting"          # a node waits to join (scale up)
    ENDED = "ended"              # the rendezvous says the round is over


@dataclasses.dataclass(frozen=True)
class RoundEvent:
    """One thing the agent must act on; `reason` for ENDED, `error` for a HOST_LOST or FORGED
    read."""

    kind: EventKind
    reason: Optional[str] = None
    error: Optional[RendezvousError] = None


class RoundWatch:
    """Watch one round's workers and rendezvous readings.

    Args:
        group: the round's workers (its `changed` event wakes the watch).
        poller: the thread reading the rendezvous.
        interval: the longest the watch sleeps between looks.
        signalled: whether a signal reached the agent.
        host_lost: whether the run's store is known to be gone.
    """

    def __init__(self, group: WorkerGroup, poller: RoundPoller, interval: float, *,
                 signalled: Callable[[], bool], host_lost: Callable[[], bool]):
        self._group = group
        self._poller = poller
        self._interval = interval
        self._signalled = signalled
        self._host_lost = host_lost
        self._seen = 0
        self._unreachable_since: Optional[float] = None

    def next_event(self) -> RoundEvent:
        """Block until something needs the agent; return it."""
        group = self._group
        while True:
            group.changed.wait(self._interval)
            group.changed.clear()
            if self._signalled():
                return RoundEvent(EventKind.INTERRUPTED)
            if self._host_lost():
                return RoundEvent(EventKind.HOST_LOST)
            state = group.state()
            if state == "failed":
                return RoundEvent(EventKind.FAILED)
            if state == "succeeded":
                return RoundEvent(EventKind.SUCCEEDED)
            event = self._read_poll()
            if event is not None:
                return event

    def _read_poll(self) -> Optional[RoundEvent]:
        """The event in the poller's newest reading, if it is new and says something."""
        poll = self._poller.latest()
        if poll is None or poll.seq == self._seen:
            return None
        self._seen = poll.seq
        now = time.monotonic()
        if poll.error is not None:
            if isinstance(poll.error, StoreHostLostError):
                return RoundEvent(EventKind.HOST_LOST, error=poll.error)
            if isinstance(poll.error, ForgedValueError):
                return RoundEvent(EventKind.FORGED, error=poll.error)
            if self._unreachable_since is None:
                self._unreachable_since = now
                logger.warning("Cannot read the rendezvous; the workers go on while it "
                               "retries: %s", poll.error)
            return None
        if self._unreachable_since is not None:
            logger.warning("The rendezvous is back after %.1fs", now - self._unreachable_since)
            self._unreachable_since = None
        if poll.waiting > 0:
            return RoundEvent(EventKind.WAITING)
        if poll.reason is not None:
            return RoundEvent(EventKind.ENDED, reason=poll.reason)
        return None
