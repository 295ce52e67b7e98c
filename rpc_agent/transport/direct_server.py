"""The accepting side of the RPC streams driven through grpcio's Cython layer (see
transport/direct.py, which holds both ends' calls): a server for one streaming method whose every
accepted call gets a completion queue of its own, and the thread that sees rejected calls out.

The accept thread stays off the server's completion queue while no connection is being set up.
Under gRPC's `poll` strategy (transport/grpc_tuning.py) an accepted connection's socket belongs to
the pollset of the server's queue as well as to that of its call's queue, so a thread blocked on
the server's queue watches every served stream beside the stream's own reader: gRPC hands the
socket's read watch from one poller to the other on every message (a kick each way), and the
accept thread often reads the message itself and then wakes the reader. That cost the serving
worker of an rpc_sync round trip 4.5 polls, 2.5 wake-up writes and 2.2 futex calls (strace, 2,000
round trips), and 1.1 polls and 0.8 futex calls without it. So, once a connection's setup has had
`_SETUP_HOLD_S`, the thread waits on the listening sockets themselves (`_QuietWait`) and drains the
queue without blocking every `_SWEEP_S` (handshakes still under way, gRPC's timers); a connection
arriving, or stop(), puts it back on the queue at once. This holds only where gRPC's own listener
accepts connections on the thread that polls (`quiet_accept`, grpc_tuning's choice): an
EventEngine listener accepts on threads of its own, and a call it accepts would wait for a sweep.
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import select
import socket
import threading
import time
from typing import Callable, Optional

from shoal.rpc_agent.transport.direct import CALL_OK, NO_FLAGS, STATUS, cygrpc

logger = logging.getLogger(__name__)

_SHUTDOWN = object()
# A rejected client that does not take its status within this long is cut off.
_REJECT_WAIT_S = 5.0
# Rejected calls beyond this many waiting are cancelled at once (their status may not arrive).
_MAX_REJECTIONS = 64
# The accept thread stays on the server's queue this long after a connection arrived or a call
# was accepted (a handshake takes a few round trips of milliseconds), then waits quietly.
_SETUP_HOLD_S = 0.5
# A quiet accept thread drains the server's queue without blocking this often: it moves on
# handshakes whose bytes came after the hold, and gRPC's timers (the idle-connection bound).
_SWEEP_S = 0.05


class Accepted:
    """A call StreamServer accepted and has not read from: its metadata and its queue."""

    __slots__ = ("call", "queue", "metadata", "peer")

    def __init__(self, call, queue, metadata, peer: str):
        self.call = call
        self.queue = queue
        self.metadata = metadata
        self.peer = peer

    def reject(self, code_name: str, details: str) -> bool:
        """Answer with a status and read nothing. Only for a call nothing was started on;
        True if the status is on its way (the server's rejection thread waits for it)."""
        operations = (
            cygrpc.SendInitialMetadataOperation(None, NO_FLAGS),
            cygrpc.SendStatusFromServerOperation(
                None, getattr(cygrpc.StatusCode, code_name), details.encode(), NO_FLAGS),
        )
        if self.call.start_server_batch(operations, STATUS) == CALL_OK:
            return True
        self.call.cancel()  # nothing outstanding: the queue may go
        return False


class _Rejections:
    """One thread that waits for rejected calls' statuses to leave, in turn, each for at most
    `_REJECT_WAIT_S` (then the call is cancelled): unauthenticated clients cost no thread of
    their own. Past `_MAX_REJECTIONS` waiting, calls are cancelled at once."""

    def __init__(self, name: str):
        self._queue: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"shoal-rpc-reject-{name}")
        self._thread.start()

    def reject(self, accepted: "Accepted", code_name: str, details: str) -> None:
        """Reject `accepted` (see Accepted.reject) and see its status out."""
        if not accepted.reject(code_name, details):
            return
        with self._lock:
            self._waiting += 1
            hurry = self._waiting > _MAX_REJECTIONS
        if hurry:
            accepted.call.cancel()
        self._queue.put(accepted)

    def stop(self) -> None:
        """End the thread once what is queued has been waited for."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            accepted = self._queue.get()
            if accepted is None:
                return
            # One batch is outstanding; a client that does not take it is cut off.
            event = accepted.queue.poll(time.time() + _REJECT_WAIT_S)
            if event.completion_type == cygrpc.CompletionType.queue_timeout:
                accepted.call.cancel()
                accepted.queue.poll()
            with self._lock:
                self._waiting -= 1
            del accepted, event


class StreamServer:
    """A gRPC server for one streaming method, driven through cygrpc: each accepted call gets a
    completion queue of its own (requested before the call arrives), which its reader polls.

    Args:
        host: the address to bind (port 0: any free port).
        options: gRPC channel arguments of the server.
        method: the one method served ("/package.Service/Method"); others get UNIMPLEMENTED.
        on_call(accepted): called on the accept thread for every call of `method`; it must
            reject it (StreamServer.reject) or hand it to a ServerCall whose reader reads it to
            its end, quickly, and bound how many it keeps. If it raises, it must not have
            started anything on the call (the server then rejects it).
        name: for the accept thread's name.
        quiet_accept: the accept thread leaves the queue between connections (see the module
            docstring); only where gRPC core polls with `poll` and its own listener.
    """

    def __init__(self, host: str, options: list, method: str,
                 on_call: Callable[[Accepted], None], name: str, quiet_accept: bool = False):
        self._host = host
        self._method = method.encode()
        self._on_call = on_call
        self._name = name
        self._queue = cygrpc.CompletionQueue()
        self._server = cygrpc.Server(tuple(options), False)
        self._server.register_completion_queue(self._queue)
        self._thread: Optional[threading.Thread] = None
        self._rejections: Optional[_Rejections] = None
        # Held while deciding to request another call, while starting the shutdown (cygrpc
        # refuses request_call once it began) and around destroy (stop's cancel_all_calls
        # must not run on a destroyed server).
        self._lock = threading.Lock()
        self._stopping = False
        # How the accept thread waits while no connection is being set up (see the module
        # docstring); None where the listening sockets were not found: it stays on the queue.
        self._quiet: Optional[_QuietWait] = None
        self._quiet_accept = quiet_accept

    def start(self) -> int:
        """Bind and start; the port (0 if binding failed)."""
        port = self._server.add_http2_port(f"{self._host}:0".encode())
        if not port:
            return 0
        self._server.start()
        if self._quiet_accept:
            self._quiet = _QuietWait.over_listeners(port)
        self._rejections = _Rejections(self._name)
        self._request()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"shoal-rpc-accept-{self._name}")
        self._thread.start()
        return port

    @property
    def waits_quietly(self) -> bool:
        """True when the accept thread leaves the server's queue between connections (its
        listening sockets were found; see the module docstring)."""
        return self._quiet is not None

    @property
    def running(self) -> bool:
        """True until the accept thread ended (after stop)."""
        return self._thread is not None and self._thread.is_alive()

    def reject(self, accepted: Accepted, code_name: str, details: str) -> None:
        """Answer a call nothing was started on with a status (see Accepted.reject)."""
        self._rejections.reject(accepted, code_name, details)

    def _request(self) -> None:
        call_queue = cygrpc.CompletionQueue()
        self._server.request_call(call_queue, self._queue, call_queue)

    def _accept_loop(self) -> None:
        quiet = self._quiet
        on_queue_until = time.monotonic() + _SETUP_HOLD_S
        while True:
            if quiet is None or self._stopping:
                event = self._queue.poll()
            else:
                left = on_queue_until - time.monotonic()
                if left > 0:
                    event = self._queue.poll(time.time() + left)
                else:
                    if quiet.wait(_SWEEP_S):
                        on_queue_until = time.monotonic() + _SETUP_HOLD_S
                    event = self._queue.poll(time.time())  # a sweep: returns at once
                if event.completion_type == cygrpc.CompletionType.queue_timeout:
                    continue
                on_queue_until = time.monotonic() + _SETUP_HOLD_S
            if event.tag is _SHUTDOWN:
                self._rejections.stop()
                with self._lock:  # not while stop() is still cancelling calls on it
                    self._server.destroy()
                if quiet is not None:
                    quiet.close()
                return
            if event.completion_type == cygrpc.CompletionType.operation_complete:
                self._accepted(event)
            # Hold nothing of a call past this point (a queue is freed only when unused).
            event = None

    def _accepted(self, event) -> None:
        if not event.success:
            return  # the server is shutting down
        accepted = Accepted(event.call, event.tag, event.invocation_metadata,
                            _text(event.call.peer()))
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._request()
        if stopping:
            self.reject(accepted, "unavailable", "the worker is shutting down")
        elif event.call_details.method != self._method:
            self.reject(accepted, "unimplemented", "unknown method")
        else:
            try:
                self._on_call(accepted)
            except Exception:
                # on_call starts nothing on a call it fails on (see GrpcTransport._accept).
                logger.exception("Accepting an RPC stream from %s failed", accepted.peer)
                self.reject(accepted, "internal", "the server failed to accept the stream")

    def stop(self, timeout: float) -> None:
        """Stop accepting, cancel every call, and wait up to `timeout` for the accept thread."""
        with self._lock:
            if self._thread is None or self._stopping:
                return
            self._stopping = True
            self._server.shutdown(self._queue, _SHUTDOWN)
            self._server.cancel_all_calls()
            if self._quiet is not None:
                self._quiet.wake()  # back onto the queue, where the shutdown arrives
        self._thread.join(timeout)


class _QuietWait:
    """Waits until a connection is pending on the server's listening sockets (or `wake()`),
    without being one of gRPC's pollers. It holds their descriptor numbers, not the sockets:
    gRPC owns and closes them, and a stale number only wakes the thread early."""

    def __init__(self, fds: list[int]):
        self._wake_read, self._wake_write = os.pipe()
        self._poller = select.poll()
        for fd in fds + [self._wake_read]:
            self._poller.register(fd, select.POLLIN)

    @classmethod
    def over_listeners(cls, port: int) -> Optional["_QuietWait"]:
        """A wait over this process's TCP sockets listening on `port` (gRPC's listener, found
        through /proc/self/fd); None where there are none to be found."""
        fds = _listening_fds(port)
        return cls(fds) if fds else None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s`; True when a connection is pending or wake() was called."""
        return bool(self._poller.poll(timeout_s * 1000.0))

    def wake(self) -> None:
        """End the current or next wait at once (any thread)."""
        try:
            os.write(self._wake_write, b"x")
        except OSError:  # closed: the accept thread is gone
            pass

    def close(self) -> None:
        """Release the wake-up pipe (the accept thread, as it ends)."""
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)


def _listening_fds(port: int) -> list[int]:
    """Descriptor numbers of this process's TCP sockets listening on `port`; empty where
    /proc/self/fd cannot be read."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    found = []
    for name in names:
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            # A duplicate to look at, closed at once: the socket stays gRPC's alone.
            dup = os.dup(fd)
        except (ValueError, OSError):
            continue
        try:
            probe = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with probe:
            try:
                if (probe.family in (socket.AF_INET, socket.AF_INET6)
                        and probe.type == socket.SOCK_STREAM
                        and probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and probe.getsockname()[1] == port):
                    found.append(fd)
            except OSError:
                continue
    return found


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
