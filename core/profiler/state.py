"""The one piece of global state every hook reads: the active recorder, or None.

Hooks elsewhere (the op ledger, the RPC agent, record_function) test `state.recorder is None`
first, so a process that is not profiling pays one attribute read per hook.
"""

from __future__ import annotations

import threading
from typing import Optional

from shoal.core.profiler.events import Recorder

recorder: Optional[Recorder] = None

# A recorder of one thread only (an RPC callee profiling one call for its caller); `local_users`
# counts them, so hooks look at the thread-local one only while some thread has one.
local = threading.local()
local_users = 0


def current() -> Optional[Recorder]:
    """The recorder this thread's events go to: its own, else the process's, else None."""
    if local_users:
        rec = getattr(local, "recorder", None)
        if rec is not None:
            return rec
    return recorder
