"""`RpcAgent`: calls out, serves calls in, over the gRPC streams and the data channels.

Its parts: `workers` (the worker table), `frames` (encoding), `serving` (the callee's side);
the agent keeps the pending calls, routes incoming frames, and owns streams and threads.

Threads: per stream one reader (and a writer during bursts; rpc_agent/transport/); the worker
pool (runs incoming calls, and the callbacks of Futures completed on a reader); one reader and
one sender per data socket; the timer thread (call deadlines); the RRef delete thread. Readers
never block and never run user callbacks: they parse frames, complete plain waits, register
RRef forks in stream order, and hand everything else to the pool.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from shoal.core.auth import load_token, require_secret_for
from shoal.core.timeouts import to_seconds
from shoal.rpc_agent import _current, metrics
from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent._threads import Deadlines, WorkerPool, is_io_thread
from shoal.rpc_agent.context import _local as _context_local
from shoal.rpc_agent.dist_autograd import container as autograd_contexts
from shoal.rpc_agent.frames import (
    CALL,
    ERROR,
    HELLO,
    REMOTE_CALL,
    RESPONSE,
    FrameEncoder,
    needs_assembly,
)
from shoal.rpc_agent.futures import Future
from shoal.rpc_agent.rref import TABLE_CALLS, RRef, RRefContext
from shoal.rpc_agent.serialization import deserialize, rebuild_exception
from shoal.rpc_agent.serving import CallServer
from shoal.rpc_agent.transport import grpc_tuning
from shoal.rpc_agent.transport.assembly import Assembler
from shoal.rpc_agent.transport.data_channel import DataChannels
from shoal.rpc_agent.types import RpcBackendOptions, RpcError, RpcPeerLost, RpcTimeout, WorkerInfo
from shoal.rpc_agent.workers import WorkerRef, WorkerTable

if TYPE_CHECKING:
    from shoal.rpc_agent.transport.stream import Stream

logger = logging.getLogger(__name__)

__all__ = ["RpcAgent", "WorkerRef", "current", "qualified_name"]


def qualified_name(func: Callable) -> str:
    """`module.qualname` of a callable, for frames, logs and error messages."""
    module = getattr(func, "__module__", None) or "?"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return f"{module}.{name}"


class _Call:
    """A call this worker issued and is waiting on."""

    __slots__ = ("future", "dst", "function", "kind", "start", "stream", "timeout", "timed",
                 "context_id", "accepts", "confirms")

    def __init__(self, future, dst, function, kind, stream, timeout, timed, context_id):
        self.future = future
        # The distributed autograd context the call was made in: its reply records into it.
        self.context_id = context_id
        # RRef forks sent to their owner in this call, accepted by its outcome (rref.py).
        self.accepts = None
        # The fork a remote() call creates, confirmed by its outcome (rref.py), or None.
        self.confirms = None
        self.dst = dst
        self.function = function
        self.kind = kind
        self.start = time.perf_counter()
        self.stream = stream
        self.timeout = timeout
        # True when the timer thread holds its deadline (not for rpc_sync: its waiter does).
        self.timed = timed


class _LocalStream:
    """Calls to this worker itself: frames go straight to the agent's own frame handler
    (`on_frames`), and the call it hands back runs on the pool (`submit`)."""

    alive = True
    outgoing = True

    def __init__(self, me: WorkerInfo, on_frames: Callable, submit: Callable):
        self._on_frames = on_frames
        self._submit = submit
        self.peer_id = me.id
        self.peer_name = me.name
        self.pending_ids: set[int] = set()

    def describe(self) -> str:
        """The stream's peer, for messages: this worker itself."""
        return f"worker {self.peer_name!r} (id {self.peer_id}, this worker)"

    def send(self, frame: bytes, more_coming: bool = False, waits: bool = False) -> None:
        """Hand one serialized frame to this worker's own frame handler (at once: nothing is
        gained by waiting for `more_coming`)."""
        inline = self._on_frames(self, [rpc_pb2.Frame.FromString(frame)])
        if inline is not None:
            self._submit(inline)


class RpcAgent:
    """One worker's RPC agent; `rpc_agent.init_rpc` creates and starts it."""

    def __init__(self, name: str, rank: int, world_size: int, options: RpcBackendOptions):
        self.info = WorkerInfo(name, rank)
        self.world_size = world_size
        if options.host is None:  # built directly, not by init_rpc: stay on this machine
            options = dataclasses.replace(options, host="127.0.0.1")
        self.options = options
        self._token = load_token(options.token)
        # The gRPC port runs code for whoever holds the secret: never with the public one.
        require_secret_for(self._token, options.host, f"RPC worker {name!r} binding its ports")
        self.workers = WorkerTable(self.info, world_size)
        self._pending: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._streams: dict[int, Stream] = {}
        self._all_streams: set = set()
        self._streams_lock = threading.Lock()
        self._closing = False
        self._closed = False
        self._default_timeout = options.rpc_timeout
        self._assembler = Assembler()
        self._pool = WorkerPool(options.num_worker_threads, name)
        self._local = _LocalStream(self.info, self._on_frames, self._pool.submit)
        self._deadlines = Deadlines(self._on_deadline, name)
        self.rrefs = RRefContext(self)
        # The one place shoal loads grpc, and late on purpose: gRPC core reads its process-wide
        # settings as grpc loads, so shoal's tuning goes into the environment just before
        # (transport/grpc_tuning.py). This is no cycle dodged: transport.grpc never imports
        # the agent.
        grpc_tuning.apply()
        from shoal.rpc_agent.transport.grpc import GrpcTransport  # noqa: PLC0415  (see above)

        self._transport = GrpcTransport(
            name=name, worker_id=rank, token=self._token, host=options.host,
            max_streams=2 * world_size, on_frames=self._on_frames,
            on_stream_open=self._on_stream_open,
            on_stream_dead=self._on_stream_dead, peer_name=self.workers.name_of,
            submit=self._pool.submit,
        )
        self._data = DataChannels(
            name=name, worker_id=rank, token=self._token, host=options.host,
            on_transfer=self._assembler.arrived, on_dead=self._assembler.drop_peer,
            peer_label=self.workers.label_of, receive_cache_bytes=options.receive_cache_bytes,
        )
        # Bound once: the per-call paths look up one attribute, as when these were methods.
        self._encode = FrameEncoder(rank, options.data_threshold, self._data.new_transfer_id).encode
        self._serve = CallServer(self.info, self._encode, self._data, self.workers).serve
        self.grpc_port: Optional[int] = None
        self.data_port: Optional[int] = None

    # ------------------------------------------------------------------ lifecycle

    def start_servers(self) -> None:
        """Bind and start the gRPC server and the data port."""
        self.grpc_port = self._transport.start()
        self.data_port = self._data.start()

    @property
    def grpc_incarnation(self) -> bytes:
        """This process's gRPC incarnation nonce, published beside its address (hellos to it
        must name it)."""
        return self._transport.incarnation

    def set_workers(self, infos: list[dict]) -> None:
        """Install the job's worker table (from the store)."""
        self.workers.install(infos)

    def connect_higher_peers(self, timeout: float) -> None:
        """Open the stream and data channel of every pair where this worker has the lower id,
        so that each pair ends up with exactly one of each."""
        streams = []
        for peer_id in range(self.info.id + 1, self.world_size):
            streams.append(self._stream_to(peer_id))
            self._data.connect(peer_id, self.workers.data_addresses[peer_id])
        end = time.monotonic() + timeout
        for stream in streams:
            stream.opened.wait(max(0.0, end - time.monotonic()))
            if stream.state != stream.OPEN:
                raise RpcError(
                    f"Worker {self.info.name!r} could not open its RPC stream to "
                    f"{stream.describe()} within {timeout:g}s: {stream.dead_reason or 'no answer'}."
                )

    def has_stream_from(self, peer_id: int) -> bool:
        """True when a live stream to `peer_id` exists (init waits for the lower peers')."""
        stream = self._streams.get(peer_id)
        return stream is not None and stream.alive

    def pending_summary(self) -> str:
        """The calls this worker still waits on, for shutdown's error message."""
        calls = list(self._pending.values())
        shown = ", ".join(f"{c.function} on {c.dst.name!r}" for c in calls[:5])
        more = f" and {len(calls) - 5} more" if len(calls) > 5 else ""
        return f"{len(calls)} call(s) still pending ({shown}{more})"

    def pending_count(self) -> int:
        """How many calls this worker issued and still waits on."""
        return len(self._pending)

    def begin_close(self) -> None:
        """Stop logging peers' disconnects as failures (the job is shutting down)."""
        self._closing = True

    def close_outgoing(self) -> None:
        """Close the streams this worker dialed (shutdown does this on every worker before
        any server stops, so that no side sees its peer vanish)."""
        self._closing = True
        self._transport.close_channels()

    def close(self) -> None:
        """Tear everything down; pending calls fail."""
        if self._closed:
            return
        self._closing = True
        self._closed = True
        self.rrefs.close()
        autograd_contexts.clear()
        self._transport.stop()
        self._data.close()
        for rid in list(self._pending):
            self._fail(rid, RpcError(f"The RPC agent of worker {self.info.name!r} shut down."))
        self._deadlines.stop()
        self._pool.stop(timeout=0.5)

    # ------------------------------------------------------------------ names

    def worker_info(self, ref: Optional[WorkerRef] = None) -> WorkerInfo:
        """The WorkerInfo of a name, id or WorkerInfo (this worker's for None).

        Raises:
            RpcError: no such worker in this job.
        """
        return self.workers.info(ref)

    def all_workers(self) -> list[WorkerInfo]:
        """Every worker of the job, by id."""
        return self.workers.all()

    # ------------------------------------------------------------------ timeouts

    def timeout_or_none(self, timeout) -> Optional[float]:
        """A call's timeout in seconds: the default for None, no limit (None) for 0."""
        # None, or torch's UNSET_RPC_TIMEOUT (-1): the agent's default.
        unset = timeout is None or (isinstance(timeout, (int, float)) and timeout == -1)
        seconds = self._default_timeout if unset else to_seconds(timeout)
        return None if seconds == 0 else seconds

    @property
    def default_timeout(self) -> float:
        """The default call timeout in seconds (0: no limit)."""
        return self._default_timeout

    def set_default_timeout(self, timeout) -> None:
        """Change the default timeout of later calls (calls in flight keep theirs)."""
        try:
            seconds = to_seconds(timeout)
        except ValueError as exc:
            raise ValueError(f"The RPC timeout must be seconds >= 0 (0: none): {exc}.") from exc
        if seconds is None:
            raise ValueError("The RPC timeout must be seconds >= 0 (0: none), got None.")
        self._default_timeout = seconds

    def default_timeout_or_none(self) -> Optional[float]:
        """The default call timeout, None when it is 0 (no limit)."""
        return None if self._default_timeout == 0 else self._default_timeout

    # ------------------------------------------------------------------ calling out

    def call(self, to: WorkerRef, func: Callable, args: Optional[tuple], kwargs: Optional[dict],
             timeout, kind: str) -> Future:
        """Send `func(*args, **kwargs)` to `to`; the Future gets its result."""
        return self._send_call(to, func, args, kwargs, timeout, kind, None)

    def call_sync(self, to: WorkerRef, func: Callable, args: Optional[tuple],
                  kwargs: Optional[dict], timeout, kind: str = "sync") -> Any:
        """`call` and wait for the result; the waiting thread enforces the timeout itself and
        writes the frame itself (with any queued before it) rather than leave it to the
        stream's writer thread: it blocks next, so no burst of its own follows.

        No deadline goes to the timer thread: registering and removing one per call costs a
        lock round trip each on the path of every reply (bench/rpc.py sync_64B).

        Raises:
            RpcTimeout: no reply in time (names the callee and the function).
        """
        rid_box: list = []
        future = self._send_call(to, func, args, kwargs, timeout, kind, None, rid_box)
        if not future.done():
            rid, seconds = rid_box
            if not future.wait_done(seconds):
                self._on_deadline(rid)
                # The reply may have been taken for completion just before: it completes soon.
                future.wait_done(None)
        return future.value()

    def internal_call(self, to: int, func: Callable, args: tuple) -> Future:
        """A call of the RRef protocol (kind "rref", default timeout)."""
        if self._closed:
            raise RpcError(f"The RPC agent of worker {self.info.name!r} is shut down.")
        return self._send_call(to, func, args, None, None, "rref", None)

    def remote(self, to: WorkerRef, func: Callable, args: Optional[tuple],
               kwargs: Optional[dict], timeout) -> RRef:
        """Run `func` on `to` and return an RRef to its result, which `to` keeps."""
        dst = self.worker_info(to)
        if dst.id == self.info.id:
            record = self.rrefs.new_record()
            rref = RRef._make(self, self.info, record.rref_id, None, record)
            # A REMOTE_CALL to itself: serving it keeps the object the function returned in
            # this record, as any owner does (torch's OwnerRRef holds the value itself, not a
            # pickled copy); the reply only says that it is set.
            fut = self._send_call(dst, func, args, kwargs, timeout, "remote", record.rref_id)

            def settle(f: Future) -> None:
                if f.exception() is not None:  # never served (say it timed out): the record fails
                    record.future.try_complete(None, f.exception())

            fut.add_done_callback(settle)
            rref.set_creation_future(fut)
            return rref
        rref_id = self.rrefs.new_id()
        rref = self.rrefs.new_user(dst, rref_id, rref_id)
        # Any outcome confirms the fork (`_complete` does, in the thread that reads the reply,
        # rather than a callback, which would hand the completion to a pool thread): the owner
        # registered it on arrival, or never saw it (then the delete it gets is ignored).
        fut = self._send_call(dst, func, args, kwargs, timeout, "remote", rref_id,
                              confirms=rref_id)
        rref.set_creation_future(fut)
        return rref

    def _send_call(self, to, func, args, kwargs, timeout, kind, rref_id,
                   sync_deadline: Optional[list] = None, confirms=None) -> Future:
        """Send one call. With `sync_deadline` (a list), the caller waits and enforces the
        timeout itself: no timer is set, and (request id, seconds) are appended to it."""
        if self._closed:
            raise RpcError(f"The RPC agent of worker {self.info.name!r} is shut down.")
        if not callable(func):
            raise TypeError(f"RPC needs a callable, got {func!r}.")
        dst = self.workers.info(to)
        fname = qualified_name(func)
        seconds = self.timeout_or_none(timeout)
        future: Future = Future(f"the {kind} call of {fname} on worker {dst.name!r}")
        rid = next(self._ids)
        frame_kind = CALL if rref_id is None else REMOTE_CALL
        cid = getattr(_context_local, "context_id", None)
        accepts: list = []
        try:
            frame, big = self._encode(
                frame_kind, rid, fname, (func, args or (), kwargs), dst.id, rref_id, cid,
                accepts,
            )
        except Exception as exc:
            raise RpcError(
                f"The arguments of {fname} for worker {dst.name!r} cannot be pickled: {exc}"
            ) from exc
        stream = self._local if dst.id == self.info.id else self._stream_to(dst.id)
        timed = seconds is not None and sync_deadline is None
        call = _Call(future, dst, fname, kind, stream, seconds, timed, cid)
        if accepts:
            call.accepts = accepts
        call.confirms = confirms
        if cid is not None:
            autograd_contexts.note_peer(cid, dst.id)
        self._pending[rid] = call
        stream.pending_ids.add(rid)
        metrics.INFLIGHT.inc()
        if timed:
            self._deadlines.add(rid, seconds)
        elif sync_deadline is not None:
            sync_deadline += (rid, seconds)
        try:
            # A remote() to a peer is mostly followed at once by its to_here() (or by more
            # remote() calls): its frame waits for them, so that they leave in one message.
            stream.send(frame, confirms is not None, sync_deadline is not None)
            if big:
                self._data.send(dst.id, self.workers.data_addresses[dst.id], big,
                                lambda exc, rid=rid: self._fail(rid, exc))
        except RpcError as exc:
            self._fail(rid, RpcPeerLost(
                f"The {kind} call of {fname} on worker {dst.name!r} (id {dst.id}) could not be "
                f"sent: {exc}"
            ))
        return future

    def _stream_to(self, peer_id: int) -> Stream:
        stream = self._streams.get(peer_id)
        if stream is not None and stream.alive:
            return stream
        with self._streams_lock:
            stream = self._streams.get(peer_id)
            if stream is None or not stream.alive:
                if self._closed:
                    raise RpcError(f"The RPC agent of worker {self.info.name!r} is shut down.")
                name = self.workers.name_of(peer_id)
                stream = self._transport.connect(peer_id, name,
                                                 self.workers.grpc_addresses[peer_id],
                                                 self.workers.grpc_incarnations[peer_id])
                self._streams[peer_id] = stream
                self._all_streams.add(stream)
        return stream

    # ------------------------------------------------------------------ completing calls

    def _complete(self, rid: int, result: Any, exc: Optional[BaseException], status: str) -> None:
        call = self._pending.pop(rid, None)
        if call is None:
            return  # already timed out or failed
        call.stream.pending_ids.discard(rid)
        if call.accepts is not None:
            for fork_id in call.accepts:
                self.rrefs.accept_child(fork_id)
        if call.confirms is not None:
            self.rrefs.confirm(call.confirms)
        if call.timed:
            self._deadlines.remove(rid, call.timeout)
        metrics.INFLIGHT.dec()
        metrics.REQUEST_CHILDREN[(call.kind, status)].inc()
        metrics.LATENCY_CHILDREN[call.kind].observe(time.perf_counter() - call.start)
        if call.future.has_callbacks() and is_io_thread():
            # Callbacks may block or call out: never on the io thread.
            self._pool.submit(call.future.try_complete, result, exc)
        else:
            call.future.try_complete(result, exc)

    def _fail(self, rid: int, exc: BaseException, status: str = "error") -> None:
        self._complete(rid, None, exc, status)

    def _on_deadline(self, rid: int) -> None:
        call = self._pending.get(rid)
        if call is None:
            return
        self._fail(rid, RpcTimeout(
            f"The {call.kind} call of {call.function} on worker {call.dst.name!r} "
            f"(id {call.dst.id}) timed out after {call.timeout:g}s."
        ), status="timeout")

    # ------------------------------------------------------------------ frames in

    def _on_frames(self, stream, frames) -> Optional[Callable[[], None]]:
        """Route one batch. Returns what the stream's reader runs itself (saving a thread
        hand-off): the batch's RRef table calls (rref.TABLE_CALLS), then its first plain
        incoming call; the other calls go to the pool."""
        inline = None
        quick: list = []
        for frame in frames:
            kind = frame.kind
            if kind == RESPONSE or kind == ERROR:
                if frame.request_id not in self._pending:
                    # A late reply to a call that timed out: its buffers are not wanted.
                    self._assembler.discard(stream.peer_id, frame)
                    continue
                if needs_assembly(frame):
                    self._assembler.expect(stream.peer_id, frame, stream, self._finish_reply)
                else:
                    self._finish_reply(frame, frame.payload, None, None)
            elif kind == CALL or kind == REMOTE_CALL:
                record = None
                if kind == REMOTE_CALL and stream is self._local:
                    # remote() to this worker: the caller's RRef is the owner's; no fork
                    record = self.rrefs.record((frame.rref_id.created_on, frame.rref_id.local_id))
                elif kind == REMOTE_CALL:
                    # Registered here, in stream order, before anything can delete this fork.
                    record = self.rrefs.add_fork(
                        (frame.rref_id.created_on, frame.rref_id.local_id),
                        (frame.fork_id.created_on, frame.fork_id.local_id),
                        confirmed=True,
                    )
                if needs_assembly(frame):
                    self._assembler.expect(
                        stream.peer_id, frame, stream,
                        lambda f, p, b, e, s=stream, r=record: self._pool.submit(
                            self._serve, s, f, p, b, e, r),
                    )
                elif kind == CALL and frame.function in TABLE_CALLS:
                    # An RRef table call runs here, before the batch's first plain call: a
                    # to_here() that came with its remote() then waits on the value before
                    # the value is set, and is answered by the thread that sets it.
                    quick.append(functools.partial(self._serve, stream, frame, frame.payload,
                                                   None, None, None))
                elif inline is None:
                    inline = functools.partial(self._serve, stream, frame, frame.payload, None,
                                               None, record)
                else:
                    self._pool.submit(self._serve, stream, frame, frame.payload, None, None,
                                      record)
            elif kind == HELLO:
                logger.debug("Ignoring a repeated hello from %s", stream.describe())
            else:
                metrics.REJECTED_STREAM.inc()
                logger.warning("Worker %r dropped a frame of unknown kind %s from %s.",
                               self.info.name, kind, stream.describe())
        if quick:
            if inline is not None:
                quick.append(inline)
            inline = quick[0] if len(quick) == 1 else functools.partial(_run_each, quick)
        return inline

    def _finish_reply(self, frame, payload, buffers, error: Optional[str]) -> None:
        rid = frame.request_id
        if buffers is None:
            buffers = [bytearray(d.inline_data) for d in frame.buffers]
        if error is not None:
            self._fail(rid, RpcError(f"The reply of {frame.function} is unusable: {error}."))
            return
        if frame.kind == ERROR:
            try:
                exc = rebuild_exception(payload, frame.function)
            except Exception as exc2:  # noqa: BLE001  (an unreadable error still fails the call)
                exc = RpcError(f"The remote error of {frame.function} cannot be read: {exc2}")
            self._complete(rid, None, exc, "error")
            return
        call = self._pending.get(rid)
        try:
            if call is not None and call.context_id is not None:
                value = deserialize(payload, buffers, call.dst.id, call.context_id)
            else:
                value = deserialize(payload, buffers)
        except Exception as exc:  # noqa: BLE001  (any unpickling failure fails the call)
            where = f" from worker {call.dst.name!r}" if call is not None else ""
            err = RpcError(f"The result of {frame.function}{where} cannot be unpickled: {exc}")
            err.__cause__ = exc
            self._complete(rid, None, err, "error")
            return
        self._complete(rid, value, None, "ok")

    # ------------------------------------------------------------------ streams and channels

    def _on_stream_open(self, stream: Stream) -> None:
        with self._streams_lock:
            self._all_streams.add(stream)
            current = self._streams.get(stream.peer_id)
            if current is None or not current.alive:
                self._streams[stream.peer_id] = stream

    def _on_stream_dead(self, stream: Stream) -> None:
        with self._streams_lock:
            self._all_streams.discard(stream)
            if self._streams.get(stream.peer_id) is stream:
                del self._streams[stream.peer_id]
        self._assembler.drop_stream(stream)
        if not self._closing:
            autograd_contexts.peer_lost(stream.peer_id, stream.describe(),
                                        str(stream.dead_reason), self.info.id)
        ids = list(stream.pending_ids)
        if not self._closing or ids:
            log = logger.warning if ids and not self._closing else logger.info
            log("Worker %r lost its RPC stream to %s (%s); failing %d pending call(s).",
                self.info.name, stream.describe(), stream.dead_reason, len(ids))
        for rid in ids:
            call = self._pending.get(rid)
            if call is None:
                continue
            self._fail(rid, RpcPeerLost(
                f"The {call.kind} call of {call.function} on worker {call.dst.name!r} "
                f"(id {call.dst.id}) failed: the RPC stream to it died ({stream.dead_reason})."
            ))


def _run_each(tasks: list) -> None:
    for task in tasks:
        task()


def current() -> RpcAgent:
    """The running agent (raises RpcError before init_rpc)."""
    return _current.get()
