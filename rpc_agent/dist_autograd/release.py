"""Ending contexts on peers without a call per context.

A context ends here at once when its `with` block exits (or a release arrives); its peers
learn of it asynchronously, as in torch. The ids wait in a per-peer queue and ride on the next
distributed autograd message to that peer (a training step's backward sends one), so a
training loop pays no call of its own for cleanup. A flusher thread sends whatever waited
longer than FLUSH_AFTER_S as a release call, and shutdown sends the rest first.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from shoal.rpc_agent import _current
from shoal.rpc_agent.context import context_id as _context_id
from shoal.rpc_agent.dist_autograd import container
from shoal.rpc_agent.functions import async_execution
from shoal.rpc_agent.futures import Future

logger = logging.getLogger(__name__)

FLUSH_AFTER_S = 0.05

_cond = threading.Condition()
_pending: dict[int, list] = {}  # peer id -> [(context id, time queued)]
_flusher: Optional[threading.Thread] = None


def end_here(cid: int, origin: Optional[int]) -> None:
    """End context `cid` on this worker and queue its release for its other peers."""
    ctx = container.release(cid)
    if ctx is None:
        return
    peers = ctx.peer_ids()  # a call that got the context before it ended may still add one
    if not peers:
        return
    agent = _current.peek()
    if agent is None:
        return
    me = agent.info.id
    now = time.monotonic()
    with _cond:
        was_empty = not _pending
        for peer in peers:
            if peer != me and peer != origin:
                _pending.setdefault(peer, []).append((cid, now))
        if was_empty and _pending:
            _ensure_flusher()
            _cond.notify()


def take(peer: int) -> list:
    """The context ids waiting for `peer`, removed from the queue (they ride on a message)."""
    if not _pending:
        return []
    with _cond:
        entries = _pending.pop(peer, None)
    return [cid for cid, _ in entries] if entries else []


def apply(cids: list, origin: int) -> None:
    """Releases that arrived from `origin`: end each context here (and pass them on)."""
    for cid in cids:
        end_here(cid, origin)


@async_execution
def release_remote(cids: list, origin: int) -> Future:
    """A release call: end the contexts on this worker."""
    apply(cids, origin)
    fut: Future = Future("a context release")
    fut.set_result(None)
    return fut


def _send(agent, peer: int, cids: list) -> Future:
    with _context_id(None):
        return agent.call(peer, release_remote, (cids, agent.info.id), None, None, "async")


def flush_all(timeout: Optional[float]) -> None:
    """Send every queued release now and wait for them (shutdown calls this first)."""
    agent = _current.peek()
    with _cond:
        batches = {peer: [cid for cid, _ in entries] for peer, entries in _pending.items()}
        _pending.clear()
    if agent is None:
        return
    futures = []
    for peer, cids in batches.items():
        try:
            futures.append(_send(agent, peer, cids))
        except Exception as exc:  # noqa: BLE001  (a peer already gone: nothing to end there)
            logger.info("Could not release %d context(s) on worker id %d: %s",
                        len(cids), peer, exc)
    for fut in futures:
        try:
            fut.wait(timeout)
        except Exception as exc:  # noqa: BLE001
            logger.info("A context release failed: %s", exc)


def drop_pending() -> None:
    """Forget queued releases (the agent stopped; its peers' contexts end with them)."""
    with _cond:
        _pending.clear()


def _ensure_flusher() -> None:
    global _flusher
    if _flusher is None or not _flusher.is_alive():
        _flusher = threading.Thread(target=_flush_loop, name="shoal-dist-autograd-release",
                                    daemon=True)
        _flusher.start()


def _flush_loop() -> None:
    while True:
        with _cond:
            while not _pending:
                _cond.wait()
            oldest = min(entries[0][1] for entries in _pending.values())
            delay = oldest + FLUSH_AFTER_S - time.monotonic()
            if delay > 0:
                _cond.wait(delay)
                continue
            cutoff = time.monotonic() - FLUSH_AFTER_S
            due: dict[int, list] = {}
            for peer in list(_pending):
                entries = _pending[peer]
                old = [cid for cid, at in entries if at <= cutoff]
                if old:
                    due[peer] = old
                    rest = [(cid, at) for cid, at in entries if at > cutoff]
                    if rest:
                        _pending[peer] = rest
                    else:
                        del _pending[peer]
        agent = _current.peek()
        if agent is None:
            continue
        for peer, cids in due.items():
            try:
                _send(agent, peer, cids).add_done_callback(_log_failure)
            except Exception as exc:  # noqa: BLE001  (agent closing or peer gone)
                logger.info("Could not release %d context(s) on worker id %d: %s",
                            len(cids), peer, exc)


def _log_failure(fut: Future) -> None:
    if fut.exception() is not None:
        logger.warning("Ending distributed autograd contexts on a peer failed: %s",
                       fut.exception())
