"""How a small receive waits: a short, bounded poll of its socket, then a blocking receive.

Waking a receiver that sleeps in the kernel costs the sender an inter-processor interrupt and
the receiver a trip through the scheduler, which on a VM cost more than a whole 4 KiB exchange
(0.06 ms against 0.016 ms). A receive that polls its socket for a few tens of microseconds
catches the peer's answer without either. So the small-message path (`algorithms.Direct`)
polls, and the decision rests on what that receive needs and what the last ones saw, never on
the machine's load average (which lags by a minute and counts work that does not compete):

- The poll is bounded (`SPIN_S`, or SHOAL_SPIN_US): a receive whose peer is late wastes at most
  that much CPU, then sleeps in the kernel as it would without polling.
- When this process may use fewer cores than the group has ranks (several ranks per core), a
  receive never polls: the peer it waits for may need this very core. (Polling with
  `sched_yield` between tries measured worse: 0.47 against 0.28 ms for a 4 KiB all_reduce of
  4 ranks on 2 busy cores, since the yield hands the core to any other runnable process.)
- Every receive counts whether its answer came within the window. After a run of misses
  (peers that answer late: a straggler, an overloaded machine), polling stops for a few
  receives and is then tried again, so a slow phase wastes at most a third of the windows and
  the fast path comes back by itself as soon as the peers answer promptly.
"""

from __future__ import annotations

import socket
import time

from shoal.collectives import env

_DONTWAIT = socket.MSG_DONTWAIT

# Misses needed (and outnumbering hits) before polling pauses, and how many receives it pauses.
# The pause must be shorter than the run of misses that starts one: a paused rank answers late
# (it sleeps in the kernel), so its peers miss; if a peer could pause again before this rank's
# pause ended, the two could take turns pausing and never poll together (measured: 0.051 ms
# instead of 0.013 ms for a 4 KiB all_reduce with 8 misses and a 500-receive pause). With a
# pause of 8 and 16 misses, the ranks always poll together again before either pauses anew.
MISSES_TO_PAUSE = 16
PAUSE_RECEIVES = 8
# Hits after which the counts restart, so an old run of misses does not outweigh a fresh one.
HITS_TO_FORGET = 64

__all__ = ["SpinPolicy", "Missed"]


class Missed(Exception):
    """Nothing arrived within the poll window (internal)."""


class SpinPolicy:
    """Whether, and how, the small receives of one rank poll before blocking.

    Args:
        window_s: the longest poll of one receive (0: never poll).
    """

    __slots__ = ("window_s", "_hits", "_misses", "_pause")

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._hits = 0
        self._misses = 0
        self._pause = 0

    @classmethod
    def for_group(cls, group_size: int, default_s: float) -> "SpinPolicy":
        """The policy of a rank of a group of `group_size` ranks: a window of SHOAL_SPIN_US if
        set, else `default_s` when this process may use a core per rank, else none
        (`collectives.env.spin_seconds`).

        Raises:
            SettingError: SHOAL_SPIN_US is not a number of microseconds of at least 0.
        """
        return cls(env.spin_seconds(group_size, default_s))

    def child(self) -> "SpinPolicy":
        """A fresh policy with the same settings (for a subset of the group's links)."""
        return SpinPolicy(self.window_s)

    @property
    def pausing(self) -> bool:
        """True while polling is paused after a run of misses."""
        return self._pause > 0

    def poll(self, sock: socket.socket, view: memoryview, need: int) -> int:
        """Poll `sock` into `view` (up to `need` bytes) for at most the window; the bytes
        received, 0 when nothing came (the caller then blocks).

        Raises:
            OSError: the socket failed (ConnectionResetError and the like); EOF returns -1.
        """
        if self.window_s <= 0:
            return 0
        if self._pause:
            self._pause -= 1
            return 0
        try:
            got = self._poll(sock, view, need)
        except Missed:
            self._missed()
            return 0
        self._hits += 1
        if self._hits >= HITS_TO_FORGET:
            self._hits = self._misses = 0
        return got if got else -1

    def _poll(self, sock, view, need) -> int:
        recv_into = sock.recv_into
        end = time.perf_counter() + self.window_s
        while True:
            try:
                return recv_into(view, need, _DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= end:
                    raise Missed() from None

    def _missed(self) -> None:
        self._misses += 1
        if self._misses >= MISSES_TO_PAUSE and self._misses > self._hits:
            self._pause = PAUSE_RECEIVES
            self._hits = self._misses = 0
