"""`RRef` and the reference counting that keeps an owner's value alive, after torch's design.

Vocabulary (torch's): the *owner* holds the value; every other worker holding an RRef holds a
*user* RRef, one *fork* of it, with its own fork id. The owner tracks its forks; it frees the
value once no fork remains (and no local handle does).

Protocol (each arrow is an RPC, so the shutdown barrier also waits for these):
- remote(): the caller's fork id is registered by the owner when the REMOTE_CALL frame
  arrives, in stream order, before the function runs; the reply confirms the caller's fork.
- The owner sends its RRef to worker U: the owner adds the new fork as pending while
  pickling; U, on unpickling, sends `_on_fork_request` to the owner, which marks it confirmed.
- User A sends its RRef to worker U: A keeps its own RRef alive as a *pending child* until the
  owner accepts the child. U sends `_on_fork_request(parent=A)`; the owner adds the fork, then
  tells A `_on_child_accept` before it answers U. If U is the owner itself, it tells A at once.
- A user fork that is garbage-collected sends `_on_delete` to the owner, but only once it is
  confirmed (a delete never overtakes the registration of its own fork); the drops of a
  couple of milliseconds leave together, one `_on_delete` per owner.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional

from shoal.core.profiler import state as _profiler
from shoal.rpc_agent import _current
from shoal.rpc_agent import serialization
from shoal.rpc_agent.types import RpcError, TimeoutArg, WorkerInfo
from shoal.rpc_agent.context import _local as _context_local
from shoal.rpc_agent.context import context_id as _context_id
from shoal.rpc_agent.dist_autograd import engine as dist_engine
from shoal.rpc_agent.functions import async_execution, is_async_execution
from shoal.rpc_agent.futures import Future

logger = logging.getLogger(__name__)

GUID = tuple  # (created_on worker id, local counter)

# How long the delete thread gathers dropped forks before it sends their deletes, one message
# per owner: an owner frees a dropped value this much later, and a loop that drops an RRef
# per iteration sends one delete per few iterations instead of a call per RRef.
DELETE_LINGER_S = 0.002

# How a proxy call is made while a profiler records: rpc_agent/profiling.py sets this when it
# is imported (rpc.py imports it, so it is set whenever RPC is usable). A hook rather than an
# import because profiling imports this module: importing it back would close a cycle.
# Called as (mode, owner, _invoke_method, call args, timeout, value type, method name).
profiled_proxy_call: Optional[Callable[..., Any]] = None


class OwnerRecord:
    """The owner's side of one RRef: its value (a Future) and the forks that keep it alive."""

    __slots__ = ("rref_id", "future", "forks", "__weakref__")

    def __init__(self, rref_id: GUID):
        self.rref_id = rref_id
        self.future: Future = Future(f"the value of RRef {rref_id}")
        self.forks: dict[GUID, bool] = {}  # fork id -> confirmed by its user


class _UserState:
    __slots__ = ("rref_id", "owner_id", "confirmed", "deleted")

    def __init__(self, rref_id: GUID, owner_id: int, confirmed: bool):
        self.rref_id = rref_id
        self.owner_id = owner_id
        self.confirmed = confirmed
        self.deleted = False


class RRef:
    """A reference to a value on one worker (its owner), as torch.distributed.rpc.RRef.

    `RRef(value)` makes a local RRef owned by this worker; `rpc_agent.remote(...)` makes one
    whose value another worker computes and keeps.
    """

    __slots__ = ("_agent", "_owner", "_rref_id", "_fork_id", "_record", "_creation",
                 "_value_type", "__weakref__")

    def __init__(self, value: Any = None):
        agent = _current.get()
        record = agent.rrefs.new_record()
        record.future.set_result(value)
        self._setup(agent, agent.info, record.rref_id, None, record)

    def _setup(self, agent, owner: WorkerInfo, rref_id: GUID, fork_id: Optional[GUID],
               record: Optional[OwnerRecord]) -> None:
        self._agent = agent
        self._owner = owner
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._record = record
        self._creation: Optional[Future] = None
        self._value_type: Optional[type] = None

    @classmethod
    def _make(cls, agent, owner: WorkerInfo, rref_id: GUID, fork_id: Optional[GUID],
              record: Optional[OwnerRecord]) -> "RRef":
        rref = cls.__new__(cls)
        cls._setup(rref, agent, owner, rref_id, fork_id, record)
        return rref

    # -- identity

    def owner(self) -> WorkerInfo:
        """The WorkerInfo of the owner."""
        return self._owner

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self._owner.name

    def is_owner(self) -> bool:
        """True on the owner."""
        return self._record is not None

    def confirmed_by_owner(self) -> bool:
        """True once the owner knows about this fork (always True on the owner)."""
        if self._record is not None:
            return True
        return self._agent.rrefs.is_confirmed(self._fork_id)

    def creation_future(self) -> Future:
        """The Future of the remote() call that created this RRef (done at once for one made
        by `RRef(value)` or received from another worker)."""
        if self._creation is not None:
            return self._creation
        fut: Future = Future("an RRef's creation")
        fut.set_result(None)
        return fut

    def _get_future(self) -> Future:
        """torch's private name of `creation_future()`, which scripts call."""
        return self.creation_future()

    def set_creation_future(self, fut: Future) -> None:
        """Make `fut` this RRef's creation future: the agent sets the remote() call's, the
        profiler one that also ends the call's event."""
        self._creation = fut

    # -- value

    def local_value(self) -> Any:
        """The value itself, on the owner (waiting for it if remote() is still running).

        Raises:
            RpcError: this worker is not the owner.
        """
        record = self._owned_record("local_value", " (use to_here())")
        return record.future.wait(self._agent.default_timeout_or_none())

    def value_future(self) -> Future:
        """On the owner, the Future of the value (done once remote() has computed it).

        Raises:
            RpcError: this worker is not the owner.
        """
        return self._owned_record("value_future", "").future

    def _owned_record(self, method: str, hint: str) -> OwnerRecord:
        if self._record is None:
            raise RpcError(f"{method}() called on worker {self._agent.info.name!r} for an RRef "
                           f"owned by {self._owner.name!r}; only the owner has the value{hint}.")
        return self._record

    def to_here(self, timeout: TimeoutArg = None) -> Any:
        """A copy of the value, fetched from the owner (the value itself on the owner); waits
        for a value that remote() has not finished computing yet.

        Raises:
            RpcTimeout: not available within `timeout` (default: the agent's rpc_timeout).
            The exception of the function that was to produce the value, if it raised.
        """
        if self._record is not None:
            return self._record.future.wait(self._agent.timeout_or_none(timeout))
        return self._agent.call_sync(self._owner, _fetch, (self._rref_id,), None, timeout,
                                     "rref")

    def _get_type(self, timeout: TimeoutArg = None) -> type:
        """The type of the value (asked of the owner once, then cached), as torch's; the
        RRef proxy checks a method's name against it before sending the call."""
        if self._value_type is None:
            if self._record is not None:
                self._value_type = type(self._record.future.wait(
                    self._agent.timeout_or_none(timeout)))
            else:
                self._value_type = self._agent.call(
                    self._owner, _fetch_type, (self._rref_id,), None, timeout, "rref").wait()
        return self._value_type

    # -- helpers of PyTorch 1.7

    def rpc_sync(self, timeout: TimeoutArg = None) -> "_Proxy":
        """`rref.rpc_sync().method(*args)` runs `method` on the owner's value, blocking."""
        return _Proxy(self, self._agent, self._get_type, "sync", timeout)

    def rpc_async(self, timeout: TimeoutArg = None) -> "_Proxy":
        """`rref.rpc_async().method(*args)` returns a Future of the method's result."""
        return _Proxy(self, self._agent, self._get_type, "async", timeout)

    def remote(self, timeout: TimeoutArg = None) -> "_Proxy":
        """`rref.remote().method(*args)` returns an RRef to the method's result, on the owner."""
        return _Proxy(self, self._agent, self._get_type, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from this RRef's value (a scalar Tensor) on its owner: a distributed
        backward pass in context `dist_autograd_ctx_id`, or local autograd for -1 (torch 1.7).

        Raises:
            DistAutogradError: as dist_autograd.backward, for a context id.
        """
        if self._record is not None:
            dist_engine.backward_on_owner(self, dist_autograd_ctx_id, retain_graph)
            return
        self._agent.call(self._owner, dist_engine.backward_on_owner,
                         (self, dist_autograd_ctx_id, retain_graph), None, None, "rref").wait()

    # -- lifetime

    def __reduce__(self):
        dst = serialization.destination()
        if dst is None:
            raise RpcError("An RRef can only be pickled as an argument or result of an RPC; it "
                           "cannot be saved or sent any other way.")
        return (_rebuild, self._agent.rrefs.fork(self, self._owner, self._rref_id, self._record,
                                                  dst))

    def __del__(self):
        fork_id = getattr(self, "_fork_id", None)
        if fork_id is not None and self._record is None:
            try:
                self._agent.rrefs.user_dropped(fork_id)
            except Exception:  # noqa: BLE001  (interpreter shutdown)
                pass

    def __repr__(self) -> str:
        role = "OwnerRRef" if self._record is not None else "UserRRef"
        return (f"{role}(rref_id={self._rref_id}, owner={self._owner.name!r}, "
                f"fork_id={self._fork_id})")


class _Proxy:
    """What rref.rpc_sync() / rpc_async() / remote() return: attribute access makes the call."""

    def __init__(self, rref: RRef, agent, get_type: Callable[[TimeoutArg], type], mode: str,
                 timeout: TimeoutArg):
        self._rref = rref
        self._agent = agent
        self._get_type = get_type  # the RRef's _get_type (torch's name), cached on the RRef
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return functools.partial(self._invoke, name)

    def _invoke(self, name: str, *args, **kwargs):
        # As torch: a name the value's type lacks fails here, before anything is sent.
        value_type = self._get_type(self._timeout)
        getattr(value_type, name)
        agent = self._agent
        call_args = (self._rref, name, args, kwargs)
        owner = self._rref.owner()
        if _profiler.recorder is not None and profiled_proxy_call is not None:
            # both sides' events, as rpc_sync/rpc_async/remote under the profiler
            return profiled_proxy_call(self._mode, owner, _invoke_method, call_args,
                                       self._timeout, value_type, name)
        if self._mode == "remote":
            return agent.remote(owner, _invoke_method, call_args, None, self._timeout)
        fut = agent.call(owner, _invoke_method, call_args, None, self._timeout,
                         "sync" if self._mode == "sync" else "async")
        return fut.wait() if self._mode == "sync" else fut


class RRefContext:
    """One agent's RRef bookkeeping: owner records, user forks, pending children, deletes."""

    def __init__(self, agent):
        self._agent = agent
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        # Strong references while forks exist; weak ones find records local handles still hold.
        self._owned: dict[GUID, OwnerRecord] = {}
        self._records: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._users: dict[GUID, _UserState] = {}
        self._children: dict[GUID, RRef] = {}
        # __del__ may run anywhere (inside a lock, on the io thread): it only puts here.
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._drop_loop, daemon=True,
                                        name=f"shoal-rpc-rref-{agent.info.name}")
        self._thread.start()

    def new_id(self) -> GUID:
        """A fresh globally unique id (this worker's id, a counter)."""
        return (self._agent.info.id, next(self._counter))

    # -- owner side

    def new_record(self) -> OwnerRecord:
        """A record for a value this worker owns (no forks yet)."""
        record = OwnerRecord(self.new_id())
        with self._lock:
            self._records[record.rref_id] = record
        return record

    def record(self, rref_id: GUID) -> OwnerRecord:
        """The record of `rref_id`, created (waiting for its value) if none exists yet: a
        fetch or fork request may overtake the REMOTE_CALL that creates it."""
        with self._lock:
            return self._record_locked(rref_id)

    def _record_locked(self, rref_id: GUID) -> OwnerRecord:
        record = self._owned.get(rref_id) or self._records.get(rref_id)
        if record is None:
            record = OwnerRecord(rref_id)
            self._records[rref_id] = record
            self._owned[rref_id] = record
        return record

    def add_fork(self, rref_id: GUID, fork_id: GUID, confirmed: bool) -> OwnerRecord:
        """Count `fork_id` as a holder of `rref_id` (REMOTE_CALL arrival, fork request)."""
        with self._lock:
            record = self._record_locked(rref_id)
            record.forks[fork_id] = confirmed or record.forks.get(fork_id, False)
            self._owned[rref_id] = record
            return record

    def delete_fork(self, rref_id: GUID, fork_id: GUID) -> None:
        """A fork is gone; drop the owner's strong reference when it was the last."""
        with self._lock:
            record = self._owned.get(rref_id) or self._records.get(rref_id)
            if record is None:
                logger.debug("Delete of unknown RRef %s fork %s ignored", rref_id, fork_id)
                return
            record.forks.pop(fork_id, None)
            if not record.forks:
                self._owned.pop(rref_id, None)

    def owned_count(self) -> int:
        """How many values this worker keeps alive for forks (tests and diagnostics)."""
        with self._lock:
            return len(self._owned)

    # -- user side

    def new_user(self, owner: WorkerInfo, rref_id: GUID, fork_id: GUID) -> RRef:
        """A user handle for `fork_id`, unconfirmed until `confirm(fork_id)`."""
        with self._lock:
            self._users[fork_id] = _UserState(rref_id, owner.id, confirmed=False)
        return RRef._make(self._agent, owner, rref_id, fork_id, None)

    def is_confirmed(self, fork_id: GUID) -> bool:
        """True once the owner acknowledged `fork_id` (or the fork is already deleted)."""
        with self._lock:
            state = self._users.get(fork_id)
            return state is None or state.confirmed

    def confirm(self, fork_id: GUID) -> None:
        """The owner knows about `fork_id`; a delete deferred until now goes to the delete
        thread. Never blocks and sends nothing itself, so the agent calls it from the thread
        that reads the reply, with no hand-off to a pool thread."""
        with self._lock:
            state = self._users.get(fork_id)
            if state is None:
                return
            state.confirmed = True
            deferred = state.deleted
        if deferred:
            self._dropped.put(fork_id)

    def user_dropped(self, fork_id: GUID) -> None:
        """Called from RRef.__del__ (any thread, any lock held): queue the delete."""
        self._dropped.put(fork_id)

    def _drop_loop(self) -> None:
        stop = False
        while not stop:
            fork_id = self._dropped.get()
            if fork_id is None:
                return
            time.sleep(DELETE_LINGER_S)  # gather a burst of drops into one message per owner
            batch = [fork_id]
            while not self._dropped.empty():
                batch.append(self._dropped.get_nowait())
            stop = None in batch
            for owner_id, pairs in self._take_deletes(batch).items():
                self._send_deletes(owner_id, pairs)

    def _take_deletes(self, batch: list) -> dict[int, list]:
        """owner id -> [(rref id, fork id)] of the confirmed forks in `batch`, taken out of the
        users (whoever takes one out sends its delete); unconfirmed ones wait for confirm()."""
        by_owner: dict[int, list] = {}
        with self._lock:
            for fork_id in batch:
                state = self._users.get(fork_id)
                if state is None:  # (None: the close marker)
                    continue
                if not state.confirmed:
                    state.deleted = True
                    continue
                del self._users[fork_id]
                by_owner.setdefault(state.owner_id, []).append((state.rref_id, fork_id))
        return by_owner

    def _send_deletes(self, owner_id: int, pairs: list) -> None:
        if self._closed:
            return
        try:
            fut = self._agent.internal_call(owner_id, _on_delete, (pairs,))
        except RpcError as exc:
            logger.debug("Delete of %d RRef fork(s) not sent: %s", len(pairs), exc)
            return
        fut.add_done_callback(functools.partial(_log_failure, "delete of RRef forks",
                                                 [f for _, f in pairs]))

    # -- pickling

    def fork(self, rref: RRef, owner: WorkerInfo, rref_id: GUID, record: Optional[OwnerRecord],
             dst: int) -> tuple:
        """Arguments of `_rebuild` for sending `rref` (owned by `owner`, kept in `record` on
        the owner) to worker `dst` (see the module doc)."""
        me = self._agent.info.id
        fork_id = self.new_id()
        with self._lock:
            if record is not None:
                record.forks[fork_id] = False
                self._owned[rref_id] = record
            else:
                self._children[fork_id] = rref
                accepts = serialization.reply_accepts()
                if accepts is not None and dst == owner.id:
                    # Sent to its owner inside a call: the owner holds a handle once it has
                    # read the arguments, so the call's reply accepts the child (no message).
                    accepts.append(fork_id)
                    return (owner.id, rref_id, fork_id, me, True)
        return (owner.id, rref_id, fork_id, me)

    def rebuild(self, owner_id: int, rref_id: GUID, fork_id: GUID, parent_id: int,
                reply_accepts: bool = False) -> RRef:
        """The receiving side of `fork`."""
        agent = self._agent
        me = agent.info.id
        owner = agent.worker_info(owner_id)
        if owner_id == me:
            record = self.record(rref_id)
            handle = RRef._make(agent, owner, rref_id, None, record)
            if parent_id == me:
                self.delete_fork(rref_id, fork_id)  # the handle now keeps the record alive
            elif not reply_accepts:
                fut = agent.internal_call(parent_id, _on_child_accept, (fork_id,))
                fut.add_done_callback(functools.partial(_log_failure, "child accept of RRef fork",
                                                         fork_id))
            return handle
        handle = self.new_user(owner, rref_id, fork_id)
        fut = agent.internal_call(owner_id, _on_fork_request, (rref_id, fork_id, parent_id))
        fut.add_done_callback(lambda f: self._fork_answered(fork_id, f))
        return handle

    def _fork_answered(self, fork_id: GUID, fut: Future) -> None:
        if fut.exception() is not None:
            logger.warning("The owner did not confirm RRef fork %s: %s", fork_id, fut.exception())
        self.confirm(fork_id)

    def accept_child(self, fork_id: GUID) -> None:
        """The owner registered our child fork: stop keeping our own RRef alive for it."""
        with self._lock:
            rref = self._children.pop(fork_id, None)
        del rref  # may run RRef.__del__, which only queues

    # -- shutdown

    def outstanding(self) -> str:
        """What still waits on other workers ('' if nothing)."""
        with self._lock:
            unconfirmed = sum(1 for s in self._users.values() if not s.confirmed)
            children = len(self._children)
        parts = []
        if unconfirmed:
            parts.append(f"{unconfirmed} RRef fork(s) not yet confirmed by their owners")
        if children:
            parts.append(f"{children} RRef(s) sent on and not yet accepted by their owners")
        return "; ".join(parts)

    def release_all_users(self) -> list[Future]:
        """Send deletes for every confirmed user fork (shutdown); later drops are ignored."""
        with self._lock:
            confirmed = [(fid, s) for fid, s in self._users.items() if s.confirmed]
            for fork_id, _ in confirmed:
                del self._users[fork_id]
        by_owner: dict[int, list] = {}
        for fork_id, state in confirmed:
            by_owner.setdefault(state.owner_id, []).append((state.rref_id, fork_id))
        futures = []
        for owner_id, pairs in by_owner.items():
            try:
                futures.append(self._agent.internal_call(owner_id, _on_delete, (pairs,)))
            except RpcError as exc:
                logger.debug("Delete of %d RRef fork(s) at shutdown not sent: %s", len(pairs),
                             exc)
        return futures

    def close(self) -> None:
        """Stop the delete thread; drops after this are ignored."""
        self._closed = True
        self._dropped.put(None)
        self._thread.join(2.0)


def _log_failure(what: str, ident, fut: Future) -> None:
    if fut.exception() is not None:
        logger.debug("The %s %s failed: %s", what, ident, fut.exception())


# ----------------------------------------------------------------------------- wire functions
# Module-level so they pickle by reference; they run on the worker the message is sent to.

def _rebuild(owner_id: int, rref_id: GUID, fork_id: GUID, parent_id: int,
             reply_accepts: bool = False) -> RRef:
    return _current.get().rrefs.rebuild(owner_id, rref_id, fork_id, parent_id, reply_accepts)


@async_execution
def _on_fork_request(rref_id: GUID, fork_id: GUID, parent_id: int) -> Future:
    agent = _current.get()
    agent.rrefs.add_fork(rref_id, fork_id, confirmed=True)
    if parent_id == agent.info.id:
        done: Future = Future("a fork confirmation")
        done.set_result(None)
        return done
    # Answer the new user only after its parent let go of its pending child, so that the
    # whole exchange is inside this one call (shutdown waits for calls, nothing else).
    return agent.internal_call(parent_id, _on_child_accept, (fork_id,))


def _on_child_accept(fork_id: GUID) -> None:
    _current.get().rrefs.accept_child(fork_id)


def _on_delete(pairs: list) -> None:
    rrefs = _current.get().rrefs
    for rref_id, fork_id in pairs:
        rrefs.delete_fork(rref_id, fork_id)


@async_execution
def _fetch(rref_id: GUID) -> Future:
    return _current.get().rrefs.record(rref_id).future


@async_execution
def _fetch_type(rref_id: GUID) -> Future:
    return _current.get().rrefs.record(rref_id).future.then(lambda f: type(f.value()))


@async_execution
def _invoke_method(rref: RRef, name: str, args: tuple, kwargs: Optional[dict]) -> Future:
    out: Future = Future(f"RRef method {name}")
    # The value may arrive on another thread: the method still runs in the caller's context
    # (and, when the caller profiles, under this call's recorder: collectives.futures sees to that).
    cid = getattr(_context_local, "context_id", None)

    def run(value_future: Future) -> None:
        try:
            method = getattr(value_future.value(), name)
            with _context_id(cid):
                result = method(*args, **(kwargs or {}))
            if is_async_execution(method):
                result.add_done_callback(lambda f: _copy_outcome(f, out))
            else:
                out.set_result(result)
        except BaseException as exc:  # noqa: BLE001  (travels back as the remote exception)
            out.set_exception(exc)

    rref.value_future().add_done_callback(run)
    return out


def _copy_outcome(src: Future, dst: Future) -> None:
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.value())


# Calls that only touch the RRef table and never block: the agent runs them first (agent.py).
TABLE_CALLS = frozenset(f"{f.__module__}.{f.__qualname__}"
                        for f in (_fetch, _fetch_type, _on_delete, _on_child_accept))
