"""A blocking, failover-capable front to aetcd, run on one private event-loop thread per process.

aetcd is asyncio-only. Each process gets one daemon thread running an event loop; blocking
callers submit coroutines to it and wait with a timeout. `EtcdClient.call` retries connection
errors across the configured endpoints until its deadline, rebuilding the gRPC channel on each
failure so a restarted etcd is reached again at once instead of after gRPC's reconnect backoff.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar, Union

import aetcd
import aetcd.exceptions as aexc

from shoal.elastic.api import RendezvousError
from shoal.elastic.rendezvous.etcd_secure import EtcdSecurity, make_client

logger = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC reconnects with exponential backoff up to minutes; keep it short, etcd is local or near.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.max_receive_message_length": 256 * 1024 * 1024 + 4096,
    "grpc.max_send_message_length": 256 * 1024 * 1024 + 4096,
}
# How long a failed channel stays open for calls still running on it.
CLOSE_GRACE_S = 5.0
# Errors after which another attempt (maybe on another endpoint) may succeed.
RETRYABLE = (
    aexc.ConnectionFailedError,
    aexc.ConnectionTimeoutError,
    aexc.InternalError,
    asyncio.TimeoutError,
    ConnectionError,
    OSError,
)


class EtcdUnavailable(RendezvousError, ConnectionError):
    """No etcd endpoint answered within the timeout."""


class _LoopThread:
    """The process's private event loop, started on first use (and again after a fork)."""

    _lock = threading.Lock()
    _instance: Optional["_LoopThread"] = None

    def __init__(self):
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="shoal-etcd-loop", daemon=True)
        self.thread.start()
        atexit.register(self._shutdown)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _shutdown(self) -> None:
        """At exit: cancel what still runs (keepalives, watch streams) so nothing is torn down
        mid-flight with "Task was destroyed but it is pending" warnings."""
        if self.pid != os.getpid() or not self.thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(2.0)
        except Exception as exc:  # noqa: BLE001  (best effort at exit)
            logger.debug("Cancelling etcd tasks at exit failed: %r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(2.0)

    @classmethod
    def get(cls) -> "_LoopThread":
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls()
            return cls._instance


def run(coro: Awaitable[T], timeout: float) -> T:
    """Run `coro` on the etcd loop and wait for it up to `timeout` seconds.

    Raises:
        asyncio.TimeoutError: it did not finish in time (it is cancelled).
    """
    loop_thread = _LoopThread.get()
    if threading.current_thread() is loop_thread.thread:
        raise RuntimeError("Blocking etcd calls cannot run on the etcd loop thread itself.")
    future = asyncio.run_coroutine_threadsafe(coro, loop_thread.loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError as exc:
        future.cancel()
        raise asyncio.TimeoutError(f"etcd call took longer than {timeout:g}s") from exc
    except concurrent.futures.CancelledError as exc:
        raise ConnectionError("the etcd call was cancelled (its loop is shutting down)") from exc


def _being_cancelled() -> bool:
    """True if the running task itself was asked to stop (not a call cancelled under it)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    return bool(cancelling and cancelling())


def spawn(coro: Awaitable[Any]) -> concurrent.futures.Future:
    """Start `coro` on the etcd loop in the background (keepalives)."""
    return asyncio.run_coroutine_threadsafe(coro, _LoopThread.get().loop)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' or 'http://host:port' -> (host, port).

    Raises:
        ValueError: anything else.
    """
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r} is not 'HOST:PORT' with a port in 1..65535.")
    return host.strip("[]"), int(port)


class EtcdClient:
    """aetcd clients over several endpoints, failing over on connection errors.

    Args:
        endpoints: 'host:port' strings (an 'http://' or 'https://' prefix is accepted).
        timeout: the default deadline of every call, in seconds.
        security: TLS files and credentials (None: plain channels, no authentication).
    """

    def __init__(self, endpoints: Sequence[str], timeout: float,
                 security: Optional[EtcdSecurity] = None):
        self.security = security
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        parsed = [parse_endpoint(e) for e in endpoints if e.strip()]
        if not parsed:
            raise ValueError("etcd needs at least one 'HOST:PORT' endpoint.")
        self.endpoints = parsed
        self.timeout = timeout
        self._index = 0
        self._client: Optional[aetcd.Client] = None
        self._pid = os.getpid()
        self._closed = False
        self._retired: set[asyncio.Task] = set()
        # Set by cap(): while an agent exits, no call may wait out the full timeout.
        self._per_call_cap: Optional[float] = None
        self._until: Optional[float] = None  # time.monotonic() after which calls fail at once
        # Set by bound_thread(): the end of the calling thread's calls (a joining node's
        # outage budget), without touching other threads' calls (heartbeats, keepalives).
        self._thread = threading.local()

    def cap(self, per_call: float, until: Optional[float] = None) -> None:
        """From now on, bound every call by `per_call` seconds and (if given) end them all by
        `until` (a time.monotonic() value); caps only ever tighten. Calls already running keep
        their budget; the agent interrupts those itself."""
        if self._per_call_cap is None or per_call < self._per_call_cap:
            self._per_call_cap = per_call
        if until is not None and (self._until is None or until < self._until):
            self._until = until

    def bound_thread(self, until: Union[None, float, Callable[[], float]]) -> None:
        """End every later call made by the calling thread by `until` (a time.monotonic()
        value, or a function that gives it when a call starts; None lifts the bound). Other
        threads' calls are not affected."""
        self._thread.until = until

    def _budget(self, timeout: Optional[float], op: str) -> float:
        budget = self.timeout if timeout is None else timeout
        if self._per_call_cap is not None:
            budget = min(budget, self._per_call_cap)
        now = time.monotonic()
        if self._until is not None:
            budget = min(budget, self._until - now)
            if budget <= 0:
                raise EtcdUnavailable(
                    f"etcd at {self.describe()}: {op} not attempted, the time allowed for "
                    "finishing is spent (etcd did not answer in time)."
                )
        thread_until = getattr(self._thread, "until", None)
        if callable(thread_until):
            thread_until = thread_until()
        if thread_until is not None:
            budget = min(budget, thread_until - now)
            if budget <= 0:
                raise EtcdUnavailable(
                    f"etcd at {self.describe()}: {op} not attempted, the caller's time for it "
                    "is spent (etcd did not answer in time)."
                )
        return budget

    def describe(self) -> str:
        """The endpoints, for messages."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    async def _current(self) -> aetcd.Client:
        if self._pid != os.getpid():
            # A forked child must not touch its parent's channel.
            self._client, self._pid = None, os.getpid()
        if self._client is None:
            host, port = self.endpoints[self._index]
            self._client = make_client(host, port, self.security, timeout=self.timeout,
                                       options=dict(_CHANNEL_OPTIONS))
        return self._client

    async def _fail_over(self, client: aetcd.Client) -> None:
        if self._client is not client:
            return  # another call already replaced it
        self._client = None
        self._index = (self._index + 1) % len(self.endpoints)
        # Closing a gRPC channel cancels every call still on it, including other threads'
        # calls that may yet succeed: close the old channel only after a grace period.
        task = asyncio.get_running_loop().create_task(self._close_later(client))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def _close_later(self, client: aetcd.Client) -> None:
        try:
            await asyncio.sleep(CLOSE_GRACE_S)
        except asyncio.CancelledError:
            pass  # this EtcdClient is closing (or the process exits): close the channel now
        try:
            await asyncio.wait_for(client.close(), 2.0)
        except Exception as exc:  # noqa: BLE001  (a broken channel may fail to close)
            logger.debug("Closing a failed etcd channel raised %r", exc)

    async def acall(
        self, fn: Callable[[aetcd.Client], Awaitable[T]], op: str, timeout: Optional[float] = None
    ) -> T:
        """Run `fn(client)` on the loop, retrying connection errors until the deadline."""
        loop = asyncio.get_running_loop()
        budget = self.timeout if timeout is None else timeout
        deadline = loop.time() + budget
        attempt = 0
        while True:
            if self._closed:
                raise EtcdUnavailable(f"The etcd client for {self.describe()} is closed ({op}).")
            attempt += 1
            client = await self._current()
            left = deadline - loop.time()
            try:
                return await asyncio.wait_for(fn(client), max(left, 0.001))
            except asyncio.CancelledError as exc:
                if _being_cancelled():
                    raise
                error: BaseException = exc  # a channel closed under the call: retry it
            except RETRYABLE as exc:
                error = exc
            except Exception as exc:
                if client is self._client:
                    raise  # a real error on a live channel
                # The channel was retired and closed under the call; aetcd then fails in odd
                # ways (its watcher is gone). Retry on the current channel.
                error = exc
            await self._fail_over(client)
            left = deadline - loop.time()
            if left <= 0:
                raise EtcdUnavailable(
                    f"etcd at {self.describe()} did not answer {op} within {budget:g}s "
                    f"({attempt} attempts); last error: {error!r}"
                ) from error
            logger.debug("etcd %s failed on attempt %d (%r); retrying", op, attempt, error)
            await asyncio.sleep(min(0.02 * 2 ** min(attempt, 5), 0.5, left))

    def call(
        self, fn: Callable[[aetcd.Client], Awaitable[T]], op: str, timeout: Optional[float] = None
    ) -> T:
        """Blocking `acall`, bounded by its timeout plus a small margin for the loop."""
        budget = self._budget(timeout, op)
        margin = 5.0 if self._per_call_cap is None else 1.0
        try:
            return run(self.acall(fn, op, budget), budget + margin)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            raise EtcdUnavailable(
                f"etcd at {self.describe()} did not answer {op} within {budget:g}s: {exc}"
            ) from exc
        except aexc.ClientError as exc:
            raise RendezvousError(f"etcd at {self.describe()} rejected {op}: {exc}") from exc

    def close(self) -> None:
        """Close the channel; later calls fail."""
        if self._closed:
            return
        self._closed = True
        client = self._client
        self._client = None
        if client is not None and self._pid == os.getpid():
            try:
                run(client.close(), 5.0 if self._per_call_cap is None else 1.0)
            except Exception as exc:  # noqa: BLE001
                logger.debug("Closing the etcd channel raised %r", exc)
        for task in list(self._retired):
            # Retired channels waiting out their grace period close now.
            _LoopThread.get().loop.call_soon_threadsafe(task.cancel)
