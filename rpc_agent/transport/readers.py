"""Who reads a stream: a leader that runs short incoming calls itself, and a follower that takes
over reading when such a call runs long or blocks.

The transport's read loop (transport/grpc.py) drives these; they know nothing of gRPC.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

# A reader running an incoming call itself hands reading on once the call has run this long
# (at once if the call waits on a Future); the watch checks twice as often.
INLINE_HANDOVER_S = 0.005
# The watch stops ticking after this long without an inline call, until the next one.
WATCH_IDLE_S = 1.0


class StreamReaders:
    """Leader/follower reading of one stream by at most two threads.

    The leader reads. When a batch brings an incoming call, the leader runs that call itself
    and then reads on: no thread hand-off at all for a short call. Waking a second reader for
    every call, as this did before, cost a context switch per call that on a 2-core machine
    competed with the call itself (bench/rpc.py sync_64B, see the commit). Reading must not
    stop for long, though (a nested call's reply may come on this stream, and a dead peer must
    show), so reading passes to the follower (started on first need) when the call waits on a
    Future (`Future.wait` calls `hand_on` through the thread's blocking hook) or when it has run
    for `INLINE_HANDOVER_S` (an `InlineWatch` calls `hand_on`). The old leader then waits as
    the follower. While one call runs inline, further calls go to the pool.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._wake = threading.Semaphore(0)
        self._follower_waiting = False
        # A follower between two states (it finished its inline call, not yet waiting) that
        # was made leader: it leads on instead of waiting.
        self._promoted = False
        self._threads = 1
        # monotonic() when the running inline call began; None when none runs.
        self.inline_since: Optional[float] = None
        self._taken = False
        self._start_reader: Optional[Callable[[], None]] = None

    def begin_inline(self, now: float, start_reader: Callable[[], None]) -> bool:
        """The leader is about to run a call itself (at monotonic time `now`); False if one
        already runs inline. `start_reader()` starts a thread that leads from here on, should
        the call be handed on before a follower waits."""
        with self._lock:
            if self.inline_since is not None:
                return False
            self._taken = False
            self._start_reader = start_reader
            self.inline_since = now
        return True

    def end_inline(self) -> bool:
        """The inline call returned; True if this thread is still the leader."""
        with self._lock:
            self.inline_since = None
            self._start_reader = None
            return not self._taken

    def hand_on(self) -> None:
        """Make another thread the leader while the inline call goes on (any thread; once)."""
        with self._lock:
            if self.inline_since is None or self._taken:
                return
            self._taken = True
            start_reader = self._start_reader
            if self._follower_waiting:
                self._follower_waiting = False
                self._wake.release()
                return
            if self._threads >= 2:
                self._promoted = True
                return
            self._threads += 1
        start_reader()

    def wait_to_lead(self, alive: Callable[[], bool]) -> bool:
        """Wait as the follower until promoted; False once `alive()` says the stream died."""
        with self._lock:
            if not alive():
                self._threads -= 1
                return False
            if self._promoted:
                self._promoted = False
                return True
            self._follower_waiting = True
        self._wake.acquire()
        if not alive():
            with self._lock:
                self._threads -= 1
            return False
        return True

    def release_follower(self) -> None:
        """The leader stops (the stream died): let a waiting follower see that and exit."""
        with self._lock:
            if self._follower_waiting:
                self._follower_waiting = False
                self._wake.release()


class InlineWatch:
    """One thread per transport that hands reading on from readers whose inline call has run
    for `INLINE_HANDOVER_S`.

    It ticks only while inline calls happen (within `WATCH_IDLE_S` of the last one) and sleeps
    otherwise, so a call costs it nothing but a timestamp; the first call after a quiet spell
    wakes it.
    """

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._readers: set[StreamReaders] = set()
        self._last_active = 0.0
        self._sleeping = False
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def watch(self, readers: StreamReaders) -> None:
        """Start checking `readers` (starts the thread on first use)."""
        with self._cond:
            self._readers.add(readers)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name=f"shoal-rpc-watch-{self._name}"
                )
                self._thread.start()

    def unwatch(self, readers: StreamReaders) -> None:
        """Stop checking `readers` (its stream is gone)."""
        with self._cond:
            self._readers.discard(readers)

    def active(self, now: float) -> None:
        """An inline call began at `now`: keep ticking (wake the thread if it sleeps)."""
        # Written before `_sleeping` is read here, read after `_sleeping` is set in `_run`:
        # one side always sees the other.
        self._last_active = now
        if self._sleeping:
            with self._cond:
                self._cond.notify()

    def stop(self) -> None:
        """End the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        tick = INLINE_HANDOVER_S / 2
        while True:
            with self._cond:
                if self._stopped:
                    return
                if time.monotonic() - self._last_active > WATCH_IDLE_S:
                    self._sleeping = True
                    if time.monotonic() - self._last_active > WATCH_IDLE_S:
                        self._cond.wait()
                    self._sleeping = False
                    continue
                self._cond.wait(tick)
                if self._stopped:
                    return
                readers = list(self._readers)
            now = time.monotonic()
            for r in readers:
                since = r.inline_since
                if since is not None and now - since >= INLINE_HANDOVER_S:
                    r.hand_on()
