"""`ProfiledResult`: what a call made under the caller's profiler returns - the value and the
callee's events. Its own module so that the agent (which profiling.py imports) can tell it apart
on a remote(): the owner keeps the value and only the events travel back."""

from __future__ import annotations

from typing import Any


class ProfiledResult:
    """The value and the callee's events (wall-clock ns tuples) of one profiled call."""

    __slots__ = ("value", "events", "worker")

    def __init__(self, value: Any, events: list, worker: str) -> None:
        self.value = value
        self.events = events
        self.worker = worker

    def without_value(self) -> "ProfiledResult":
        """The events alone, for the reply of a remote() whose owner keeps the value."""
        return ProfiledResult(None, self.events, self.worker)
