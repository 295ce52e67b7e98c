"""Host staging of cupy arrays for the tcp backend: GPU arrays work on a cluster without NCCL.

A collective on cupy arrays copies them into pinned host buffers, runs on the host like any
numpy collective, and copies the results back. Ordering with the caller's GPU work: at
submission, in the caller's thread, an event is recorded on the caller's current stream (the
stream that produced the arrays); the copy to the host, which may run later in the group's
worker thread, first waits for that event. The copy back completes (the host waits for it)
before the collective's Work completes, so whatever the caller runs after `wait()` sees it.
`HostStage.around` applies this once around an operation's job, which then sees numpy arrays
only.
Nothing here imports cupy: cupy arrays exist only where cupy was imported already.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Collection, Optional, Sequence

import numpy as np

__all__ = ["HostStage", "for_arrays"]


def for_arrays(arrays: Sequence[Any]) -> Optional["HostStage"]:
    """A HostStage when any of `arrays` (None entries allowed) is a cupy array, else None."""
    for a in arrays:
        if a is not None and not isinstance(a, np.ndarray):
            return HostStage(arrays)
    return None


class HostStage:
    """Pinned host copies of a collective's cupy arrays, by position in the submitted list."""

    __slots__ = ("_arrays", "_events", "_pinned")

    def __init__(self, arrays: Sequence[Any]):
        cp = sys.modules["cupy"]
        self._arrays = list(arrays)
        self._events: dict[int, Any] = {}
        self._pinned: dict[int, np.ndarray] = {}
        for i, a in enumerate(self._arrays):
            if a is not None and not isinstance(a, np.ndarray):
                with a.device:
                    event = cp.cuda.Event(block=False, disable_timing=True)
                    event.record(cp.cuda.get_current_stream())
                self._events[i] = event

    def around(self, job: Callable[[Any, Sequence[Any]], list],
               copy_in: Optional[Collection[int]], copy_out: Collection[int]):
        """A job that copies arrays `copy_in` (None: all) to pinned host memory, runs
        `job(record, host arrays)`, and copies arrays `copy_out` back to their devices."""
        n = len(self._arrays)

        def staged(record: Any, _arrays: Sequence[Any]) -> list:
            host = [self.host(i, copy_in=copy_in is None or i in copy_in) for i in range(n)]
            result = job(record, host)
            self.write_back(*copy_out)
            return result

        return staged

    def host(self, i: int, copy_in: bool = True) -> np.ndarray:
        """The numpy array to work on for array `i` (itself when it is a numpy array)."""
        a = self._arrays[i]
        if i not in self._events:
            return a
        pinned = self._pinned.get(i)
        if pinned is None:
            cp = sys.modules["cupy"]
            pinned = importlib.import_module("cupyx").empty_pinned(a.shape, a.dtype)
            if copy_in:
                with a.device:
                    stream = cp.cuda.get_current_stream()
                    stream.wait_event(self._events[i])
                    a.get(stream=stream, out=pinned)  # blocking: the host reads it next
            self._pinned[i] = pinned
        return pinned

    def write_back(self, *indices: int) -> None:
        """Copy the host results of arrays `indices` back to their devices, and wait for it."""
        cp = sys.modules.get("cupy")
        for i in indices:
            pinned = self._pinned.get(i)
            if pinned is None:
                continue
            a = self._arrays[i]
            with a.device:
                stream = cp.cuda.get_current_stream()
                a.set(pinned, stream=stream)
                stream.synchronize()  # the pinned buffer is free, and the data there, after this
