"""How the node agent reacts to SIGTERM, SIGINT and the other signals it forwards.

A signal is forwarded to the workers at once (by the agent's `forward` callback). While the
main thread runs rounds it also raises `AgentInterrupted` there, ending whatever blocking
rendezvous or store call it was in, except inside `critical()` sections (starting or stopping
workers), where it is raised at the section's end. If the agent is still alive well after the
grace period, something it waits on ignores every bound: a last-resort thread kills the workers
and exits, as Kubernetes would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

from shoal.elastic.agent.spec import SIGNAL_LEAVE_S, AgentInterrupted

logger = logging.getLogger(__name__)


class SignalGate:
    """The agent's signal state: which signal came, and whether it may interrupt right now.

    Args:
        grace_period: seconds the workers get after the signal.
        forward: called with each signal (from the handler): pass it on to the workers.
        on_first: called once with the time.monotonic() by which the agent must have left.
        kill: the last resort's way to kill the workers (SIGKILL) before exiting.
    """

    def __init__(self, grace_period: float, *, forward: Callable[[int], None],
                 on_first: Callable[[float], None], kill: Callable[[], None]):
        self._grace_period = grace_period
        self._forward = forward
        self._on_first = on_first
        self._kill = kill
        self._signum: Optional[int] = None
        # True while the main thread runs rounds: a signal then raises at once.
        self._interruptible = False

    @property
    def signum(self) -> Optional[int]:
        """The last signal received, or None."""
        return self._signum

    def install(self, signals: Sequence[int]) -> Callable[[], None]:
        """Handle `signals` from now on; returns a restorer of the previous handlers."""
        previous = {s: signal.signal(s, self._on_signal) for s in signals}

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return restore

    def raise_if_signalled(self) -> None:
        """Raise AgentInterrupted if a signal came."""
        if self._signum is not None:
            raise AgentInterrupted(self._signum)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """The main loop's span: a signal inside it raises AgentInterrupted at once."""
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def hold(self) -> None:
        """The signal is being handled now: a repeated one must not cut that short."""
        self._interruptible = False

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section a signal must not cut short; a signal that came meanwhile is raised at its
        end."""
        before, self._interruptible = self._interruptible, False
        try:
            yield
        finally:
            self._interruptible = before
        if before and self._signum is not None:
            raise AgentInterrupted(self._signum)

    def _on_signal(self, signum, frame) -> None:
        first = self._signum is None
        self._signum = signum
        self._forward(signum)
        if first:
            logger.warning("Received %s: forwarding it to the workers (grace period %gs)",
                           signal.Signals(signum).name, self._grace_period)
            leave_by = time.monotonic() + self._grace_period + SIGNAL_LEAVE_S
            self._on_first(leave_by)
            self._arm_last_resort(signum, leave_by + 1.0)
        if self._interruptible:
            # Break out of whatever blocking rendezvous or store call the main thread is in.
            raise AgentInterrupted(signum)

    def _arm_last_resort(self, signum: int, at: float) -> None:
        """If the agent is still alive at `at` (time.monotonic()) after a signal, kill the
        workers and exit."""
        def expire() -> None:
            time.sleep(max(0.0, at - time.monotonic()))
            logger.error("The agent did not finish within %.1fs of %s; killing its workers and "
                         "exiting now", self._grace_period + SIGNAL_LEAVE_S + 1.0,
                         signal.Signals(signum).name)
            self._kill()
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(128 + signum)

        threading.Thread(target=expire, name="shoal-agent-last-resort", daemon=True).start()
