"""The one piece of global state every hook reads: the active recorder, or None.

Hooks elsewhere (the op ledger, the RPC agent, record_function) test `state.recorder is None`
first, so a process that is not profiling pays one attribute read per hook.

Two windows may record at once: the job profiler's (`shoal run --profile`, a background one)
and a user's own `profile()` in the script it runs. Hooks record into the user's; when either
window ends, the job's gets a copy of what the user's recorded while both ran, so both traces
are whole. Two user profilers at once are refused, as torch refuses them.
"""

from __future__ import annotations

import threading
from typing import Optional

from shoal.core.profiler.events import Recorder
from shoal.core.profiler.schedule import ProfilerError

recorder: Optional[Recorder] = None

_windows_lock = threading.Lock()
_background: Optional[Recorder] = None  # the job profiler's window
_foreground: Optional[Recorder] = None  # a user's own profiler's window


def begin(rec: Recorder, background: bool) -> None:
    """Make `rec` a recording window: the one hooks record into, unless it is a background
    window and a user's window records already.

    Raises:
        ProfilerError: a window of the same kind records already.
    """
    global recorder, _background, _foreground
    with _windows_lock:
        if (_background if background else _foreground) is not None:
            raise ProfilerError(
                "profile(): another profiler is already recording in this process; stop it "
                "before starting a new one."
            )
        if background:
            _background = rec
        else:
            _foreground = rec
        recorder = _foreground or _background


def end(rec: Recorder) -> Optional[tuple[Recorder, Recorder]]:
    """Stop recording into `rec`. Returns (user's window, job's window) when the job's must
    still absorb what the user's recorded while both ran (`Recorder.absorb`), else None."""
    global recorder, _background, _foreground
    with _windows_lock:
        overlap = (_foreground, _background) if _foreground and _background else None
        if rec is _foreground:
            _foreground = None
        elif rec is _background:
            _background = None
        else:
            overlap = None
        recorder = _foreground or _background
    return overlap

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
