"""Ending an NCCL communicator without hanging the process: ncclCommAbort and ncclCommDestroy
each run in a thread of their own, and the caller waits for them only until a deadline (a call
that hangs inside NCCL is left behind, its resources leaked, rather than hanging the job)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["abort", "destroy"]

# How long an abort waits for a launch in progress to leave NCCL before aborting under it (a
# launch can block inside NCCL, e.g. connecting to a point-to-point peer that never comes).
LAUNCH_GRACE_S = 1.0


def _run_bounded(body: Callable[[], None], thread_name: str, seconds: float) -> bool:
    """Run `body` in a daemon thread; True if it returned within `seconds`."""
    done = threading.Event()

    def run() -> None:
        try:
            body()
        finally:
            done.set()

    threading.Thread(target=run, name=thread_name, daemon=True).start()
    return done.wait(seconds)


def abort(comm: Any, launch_lock: threading.RLock, wait_for_launch: bool, rank: int, name: str,
          seconds: float) -> bool:
    """ncclCommAbort of rank `rank`'s group `name`; True if it returned within `seconds`.

    With `wait_for_launch`, it first waits (briefly) for a launch holding `launch_lock` to
    leave NCCL, unless that launch hangs there.
    """
    def body() -> None:
        got = wait_for_launch and launch_lock.acquire(timeout=LAUNCH_GRACE_S)
        try:
            comm.abort()
        except Exception:
            logger.exception("Rank %d: ncclCommAbort of group %r raised", rank, name)
        finally:
            if got:
                launch_lock.release()

    if _run_bounded(body, f"shoal-nccl-{name}-abort", seconds):
        return True
    logger.error(
        "Rank %d: ncclCommAbort of group %r did not return within %gs; giving up on it (its "
        "thread stays blocked and the communicator's resources leak).", rank, name, seconds,
    )
    return False


def destroy(comm: Any, rank: int, name: str, seconds: float) -> None:
    """ncclCommDestroy of a communicator with no work pending, waiting at most `seconds`."""
    def body() -> None:
        try:
            comm.destroy()
        except Exception:
            logger.debug("ncclCommDestroy of group %r raised", name, exc_info=True)

    if not _run_bounded(body, f"shoal-nccl-{name}-destroy", seconds):
        logger.error("Rank %d: ncclCommDestroy of group %r did not return within %gs.",
                     rank, name, seconds)
