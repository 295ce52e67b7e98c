"""The one piece of global state every hook reads: the active recorder, or None.

Hooks elsewhere (the op ledger, the RPC agent, record_function) test `state.recorder is None`
first, so a process that is not profiling pays one attribute read per hook.
"""

from __future__ import annotations

import threading
from typing import Optional

from shoal.core.profiler.events import Recorder

recorder: Optional[Recorder] = None

# A recorder of one thread only (an RPC callee profiling one call for its caller, and the
# continuations of that call on other threads); `local_users` counts the threads that have one,
# so hooks look at the thread-local one only while some thread does.
local = threading.local()
local_users = 0
_local_lock = threading.Lock()


def current() -> Optional[Recorder]:
    """The recorder this thread's events go to: its own, else the process's, else None."""
    if local_users:
        rec = getattr(local, "recorder", None)
        if rec is not None:
            return rec
    return recorder


def push_local(rec: Recorder) -> Optional[Recorder]:
    """Make `rec` this thread's own recorder; returns the one it replaces (for `pop_local`)."""
    global local_users
    with _local_lock:
        local_users += 1
    previous = getattr(local, "recorder", None)
    local.recorder = rec
    return previous


def pop_local(previous: Optional[Recorder]) -> None:
    """Undo one `push_local`: this thread records to `previous` again."""
    global local_users
    local.recorder = previous
    with _local_lock:
        local_users -= 1
