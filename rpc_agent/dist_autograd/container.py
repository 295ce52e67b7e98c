"""This worker's distributed autograd contexts, and what the wire records into them.

A context holds, per worker, the *send* functions (tensors that left this worker while
requiring grad, by send id), the *recv* functions (tensors that arrived requiring grad, with
the worker and send id they came from), the peers the context touched (for cleanup and for
starting backward everywhere), and the gradients of this worker's leaves. Serialization calls
`record_send`/`record_recv` while pickling inside a context; the agent calls `touch` when a
call of a context arrives and `peer_lost` when a stream dies. Nothing here sends anything.

Threads: calls arrive, contexts begin and end, and streams die on different threads, so the
context table changes only under `_lock` and a context's peers only under its `peers_lock`;
whoever walks either walks a copy taken under that lock (a walk of the live dict or set fails
with "changed size during iteration" when another thread adds to it).
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any, Optional

from shoal.rpc_agent import _current, metrics
from shoal.rpc_agent.types import RpcPeerLost
from shoal.rpc_agent.dist_autograd.types import DistAutogradError

# torch's layout: the creating worker's id in the top 16 bits, a counter below.
_WORKER_SHIFT = 48


class DistAutogradContext:
    """One context's state on this worker (see the module docstring)."""

    __slots__ = ("context_id", "lock", "sends", "recvs", "peers", "peers_lock", "grads",
                 "passes", "finished_passes", "graph_freed", "failure")

    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        # Re-entrant: a backward pass's leaf hooks may record into the same context.
        self.lock = threading.RLock()
        self.sends: dict[int, Any] = {}
        self.recvs: dict[int, tuple] = {}  # id(tensor) -> (tensor, source worker id, send id)
        self.peers: set[int] = set()  # change with add_peer, read with peer_ids
        # Not `lock`: peers are added on the agent's receive and send paths, which must not
        # wait for a backward feed holding `lock` (a feed may block on its peers, as DDP's
        # finalize does). This lock guards one set operation and nothing runs under it.
        self.peers_lock = threading.Lock()
        self.grads: dict[int, tuple] = {}  # id(leaf) -> (leaf, grad Tensor)
        self.passes: dict[tuple, Any] = {}  # backward passes under way here, by pass id
        self.finished_passes: set[tuple] = set()
        self.graph_freed = False  # a backward without retain_graph ran
        self.failure: Optional[BaseException] = None

    def add_peer(self, peer_id: int) -> None:
        """Remember that the context involves worker `peer_id`."""
        if peer_id not in self.peers:  # the common case, a known peer, takes no lock
            with self.peers_lock:
                self.peers.add(peer_id)

    def peer_ids(self) -> tuple[int, ...]:
        """The peers so far, sorted: a copy that later additions do not change."""
        with self.peers_lock:
            return tuple(sorted(self.peers))

    @property
    def creator_id(self) -> int:
        """The id of the worker whose `context()` made this context."""
        return self.context_id >> _WORKER_SHIFT

    # torch's DistAutogradContext methods, which its tests and debugging scripts call. shoal
    # keeps no send or recv node objects: the values are the tensors sent and received. Keys
    # follow torch's autograd message ids (the sending worker's id in the top 16 bits), so a
    # send here and its recv on the peer have the same key, as in torch.

    def _context_id(self) -> int:
        """This context's id (torch's accessor)."""
        return self.context_id

    def _send_functions(self) -> dict:
        """{message id: tensor} for each tensor that left this worker requiring grad."""
        agent = _current.peek()
        me = agent.info.id if agent is not None else self.creator_id
        with self.lock:
            return {(me << _WORKER_SHIFT) | send_id: tensor
                    for send_id, tensor in self.sends.items()}

    def _recv_functions(self) -> dict:
        """{message id: tensor} for each tensor that arrived here requiring grad."""
        with self.lock:
            return {(src << _WORKER_SHIFT) | send_id: tensor
                    for tensor, src, send_id in self.recvs.values()}

    def _known_worker_ids(self) -> set:
        """The ids of the workers this context has sent calls to or received calls from."""
        return set(self.peer_ids())

    def __repr__(self) -> str:
        return (f"DistAutogradContext(id={self.context_id}, sends={len(self.sends)}, "
                f"recvs={len(self.recvs)}, peers={list(self.peer_ids())})")


_lock = threading.Lock()
_contexts: dict[int, DistAutogradContext] = {}
_counter = itertools.count(1)
_send_ids = itertools.count(1)
# Why recent contexts ended early (a dead peer), for the messages that still arrive for them.
_failures: "collections.OrderedDict[int, str]" = collections.OrderedDict()
_MAX_FAILURES = 1024


def _changed() -> None:
    metrics.DIST_CONTEXTS.set(len(_contexts))


def new_context(worker_id: int) -> DistAutogradContext:
    """A fresh context created by this worker."""
    # No other worker's id can collide with this one's (the worker id is in the top bits).
    cid = (worker_id << _WORKER_SHIFT) | next(_counter)
    ctx = DistAutogradContext(cid)
    with _lock:
        _contexts[cid] = ctx
        _changed()
    return ctx


def get(context_id: int) -> Optional[DistAutogradContext]:
    """The live context of that id on this worker, or None."""
    return _contexts.get(context_id)


def retrieve(context_id: int, worker: str) -> DistAutogradContext:
    """The live context of that id.

    Raises:
        DistAutogradError: no such context here (never made, or already ended).
    """
    ctx = _contexts.get(context_id)
    if ctx is None:
        raise DistAutogradError(
            f"Could not find autograd context with id: {context_id} on worker {worker!r}: it "
            "was never created here or has already ended (use it inside its "
            "`with dist_autograd.context()` block)."
        )
    return ctx


def touch(context_id: int, peer_id: int) -> DistAutogradContext:
    """The context a call from `peer_id` belongs to, created on first contact."""
    ctx = _contexts.get(context_id)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(context_id)
            if ctx is None:
                ctx = _contexts[context_id] = DistAutogradContext(context_id)
                why = _failures.get(context_id)
                if why is not None:
                    # A call of a context that already failed here: it stays failed (until
                    # its creator ends it), so backward names the dead peer.
                    ctx.failure = RpcPeerLost(why)
                _changed()
    ctx.add_peer(peer_id)
    return ctx


def note_peer(context_id: int, peer_id: int) -> None:
    """Remember that this worker sent a call of the context to `peer_id` (if it is live)."""
    ctx = _contexts.get(context_id)
    if ctx is not None:
        ctx.add_peer(peer_id)


def record_send(context_id: int, tensor: Any, dst_id: int) -> int:
    """A tensor that requires grad leaves for `dst_id`: its send id."""
    ctx = touch(context_id, dst_id)
    send_id = next(_send_ids)
    with ctx.lock:
        ctx.sends[send_id] = tensor
    return send_id


def record_recv(context_id: int, tensor: Any, src_id: int, send_id: int) -> None:
    """A tensor that requires grad arrived from `src_id` (its send id there)."""
    ctx = touch(context_id, src_id)
    with ctx.lock:
        ctx.recvs[id(tensor)] = (tensor, src_id, send_id)


def release(context_id: int) -> Optional[DistAutogradContext]:
    """End the context on this worker; returns it (None when it was not live)."""
    with _lock:
        ctx = _contexts.pop(context_id, None)  # one caller gets it
        if ctx is not None:
            _changed()
    return ctx


def live_count() -> int:
    """How many contexts are live on this worker."""
    return len(_contexts)


def current_pass_count() -> int:
    """How many backward passes are under way on this worker, over every live context."""
    with _lock:
        live = list(_contexts.values())
    return sum(len(ctx.passes) for ctx in live)


def live_ids() -> list[int]:
    """The ids of the live contexts (for tests and error messages)."""
    with _lock:
        return sorted(_contexts)


def peer_lost(peer_id: int, peer: str, reason: str, own_id: int) -> None:
    """A peer's stream died: every context that involves it fails. Contexts this worker
    created stay until their `with` block ends (so that backward reports the failure); the
    others end now, since nobody is left to end them reliably."""
    with _lock:
        hit = [ctx for ctx in _contexts.values() if peer_id in ctx.peer_ids()]
    for ctx in hit:
        ctx.failure = RpcPeerLost(
            f"Distributed autograd context {ctx.context_id} involves {peer}, whose RPC stream "
            f"died ({reason})."
        )
        if ctx.creator_id != own_id:
            with _lock:
                _failures[ctx.context_id] = str(ctx.failure)
                while len(_failures) > _MAX_FAILURES:
                    _failures.popitem(last=False)
            release(ctx.context_id)


def failure_of(context_id: int) -> Optional[str]:
    """Why a context ended early on this worker (its peer died), if it did."""
    return _failures.get(context_id)


def clear() -> None:
    """Drop every context (the agent shut down)."""
    with _lock:
        _contexts.clear()
        _failures.clear()
        _changed()
