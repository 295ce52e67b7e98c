"""The TCPStore server's keys and parked requests: c10d's semantics, apart from any socket.

One loop thread owns a `StoreState` (no locks). Requests arrive decoded, with an opaque `owner`
(the server's connection object); replies leave through the `respond` callback. A `get`, `wait`
or `multi_get` whose keys are missing parks on those keys and is answered by the `set` that
completes it, or by `expire` at its deadline; the `resume` callback then lets the server read
the owner's next request. Nothing polls.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Callable, Hashable, Optional

from shoal.collectives.store.rules import added, compare_set_outcome
from shoal.collectives.store.wire import FrameError, Op, Status, decode_int, decode_timeout
from shoal.collectives.store.api import MAX_KEY_BYTES

logger = logging.getLogger(__name__)

Respond = Callable[[Hashable, Status, list], None]


class _Waiter:
    """A parked GET, WAIT, MULTI_GET or WAIT_WORKERS request."""

    __slots__ = ("owner", "op", "keys", "workers", "deadline", "done")

    def __init__(self, owner, op, keys, workers, timeout):
        self.owner = owner
        self.op = op
        self.keys = keys
        self.workers = workers
        self.deadline = time.monotonic() + timeout
        self.done = False


class StoreState:
    """Keys, values, the join count and parked requests of one store server."""

    def __init__(self, respond: Respond, resume: Callable[[Hashable], None], *,
                 name: str = "TCPStore server", world_size: Optional[int] = None):
        self._respond = respond
        self._resume = resume
        self._name = name
        self.world_size = world_size
        self.joined = 0
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, set] = {}  # missing key -> requests parked on it
        self._worker_waiters: set = set()
        self._parked: dict[Hashable, _Waiter] = {}  # owner -> its one parked request
        self._deadlines: list = []
        self._seq = itertools.count()

    @property
    def num_parked(self) -> int:
        """Requests waiting for keys or workers now."""
        return len(self._parked)

    def is_parked(self, owner: Hashable) -> bool:
        """True while `owner` waits for a reply (its next request must wait too)."""
        return owner in self._parked

    def forget(self, owner: Hashable) -> None:
        """Drop the parked request of an owner that went away."""
        waiter = self._parked.get(owner)
        if waiter is not None:
            self._unpark(waiter)

    # ------------------------------------------------------------------ requests

    def handle(self, owner: Hashable, code: int, args: list[bytes]) -> None:
        """Serve one decoded request; raises FrameError when it breaks the protocol."""
        try:
            op = Op(code)
        except ValueError:
            raise FrameError(f"unknown request code {code}") from None
        reply = self._respond
        if op is Op.SET:
            key, value = _args(op, args, 2)
            self._set(_checked_key(key), value)
            reply(owner, Status.OK, [])
        elif op is Op.GET or op is Op.MULTI_GET or op is Op.WAIT:
            if len(args) < 2:
                raise FrameError(f"{op.name} needs a timeout and at least one key")
            timeout = decode_timeout(args[0])
            keys = [_checked_key(k) for k in args[1:]]
            if op is Op.GET and len(keys) != 1:
                raise FrameError(f"GET takes exactly one key, got {len(keys)}")
            self._answer_or_park(owner, op, keys, timeout)
        elif op is Op.ADD:
            key, amount = _args(op, args, 2)
            key, amount = _checked_key(key), decode_int(amount)
            try:
                value = str(added(key.decode(errors="replace"), self._data.get(key, b"0"),
                                  amount)).encode()
            except ValueError as exc:
                return reply(owner, Status.BAD_INPUT, [str(exc).encode()])
            self._set(key, value)
            reply(owner, Status.OK, [value])
        elif op is Op.COMPARE_SET:
            key, expected, desired = _args(op, args, 3)
            key = _checked_key(key)
            swap, answer = compare_set_outcome(self._data.get(key), expected, desired)
            if swap:
                self._set(key, desired)
            reply(owner, Status.OK, [answer])
        elif op is Op.CHECK:
            present = all(_checked_key(k) in self._data for k in args)
            reply(owner, Status.OK, [b"1" if present else b"0"])
        elif op is Op.DELETE:
            (key,) = _args(op, args, 1)
            existed = self._data.pop(_checked_key(key), None) is not None
            reply(owner, Status.OK, [b"1" if existed else b"0"])
        elif op is Op.NUM_KEYS:
            _args(op, args, 0)
            reply(owner, Status.OK, [str(len(self._data)).encode()])
        elif op is Op.MULTI_SET:
            if len(args) % 2:
                raise FrameError(f"MULTI_SET needs key-value pairs, got {len(args)} arguments")
            keys = [_checked_key(k) for k in args[0::2]]
            self._data.update(zip(keys, args[1::2]))
            self._wake_waiters(keys)
            reply(owner, Status.OK, [])
        elif op is Op.JOIN:
            _args(op, args, 0)
            self.joined += 1
            if self.joined == self.world_size:
                logger.info("%s: all %d workers joined", self._name, self.world_size)
            reply(owner, Status.OK, [str(self.joined).encode()])
            self._wake_worker_waiters()
        elif op is Op.WAIT_WORKERS:
            count, timeout = _args(op, args, 2)
            count, timeout = decode_int(count), decode_timeout(timeout)
            if self.joined >= count:
                return reply(owner, Status.OK, [str(self.joined).encode()])
            self._park(_Waiter(owner, op, [], count, timeout))
        elif op is Op.PING:
            reply(owner, Status.OK, args[:1])

    def _set(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake_waiters([key])

    def _answer_or_park(self, owner, op: Op, keys: list[bytes], timeout: float) -> None:
        missing = [k for k in keys if k not in self._data]
        if not missing:
            return self._answer(owner, op, keys)
        if timeout <= 0:
            return self._respond(owner, Status.TIMEOUT, missing)
        waiter = _Waiter(owner, op, keys, None, timeout)
        for k in missing:
            self._waiters.setdefault(k, set()).add(waiter)
        self._park(waiter)

    def _answer(self, owner, op: Op, keys: list[bytes]) -> None:
        values = [] if op is Op.WAIT else [self._data[k] for k in keys]
        self._respond(owner, Status.OK, values)

    # ------------------------------------------------------------------ parking

    def _park(self, waiter: _Waiter) -> None:
        self._parked[waiter.owner] = waiter
        if waiter.op is Op.WAIT_WORKERS:
            self._worker_waiters.add(waiter)
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.done = True
        self._parked.pop(waiter.owner, None)
        self._worker_waiters.discard(waiter)
        for k in waiter.keys:
            bucket = self._waiters.get(k)
            if bucket is not None:
                bucket.discard(waiter)
                if not bucket:
                    del self._waiters[k]

    def _finish(self, waiter: _Waiter, status: Status, args: list[bytes]) -> None:
        """Answer a parked request, then let its owner's next request in."""
        self._unpark(waiter)
        self._respond(waiter.owner, status, args)
        self._resume(waiter.owner)

    def _wake_waiters(self, keys: list[bytes]) -> None:
        ready = [
            w for k in keys for w in self._waiters.get(k, ())
            if all(wk in self._data for wk in w.keys)
        ]
        for waiter in ready:
            if not waiter.done:  # a waiter on several of `keys` shows up once per key
                values = [] if waiter.op is Op.WAIT else [self._data[k] for k in waiter.keys]
                self._finish(waiter, Status.OK, values)

    def _wake_worker_waiters(self) -> None:
        for waiter in [w for w in self._worker_waiters if self.joined >= w.workers]:
            self._finish(waiter, Status.OK, [str(self.joined).encode()])

    # ------------------------------------------------------------------ deadlines

    def next_deadline(self) -> Optional[float]:
        """The monotonic time of the earliest parked request's deadline, if any."""
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> None:
        """Answer every parked request whose deadline has passed with a timeout reply."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.done:
                continue
            if waiter.op is Op.WAIT_WORKERS:
                self._finish(waiter, Status.TIMEOUT, [str(self.joined).encode()])
            else:
                missing = [k for k in waiter.keys if k not in self._data]
                self._finish(waiter, Status.TIMEOUT, missing)


def _args(op: Op, args: list[bytes], n: int) -> list[bytes]:
    if len(args) != n:
        raise FrameError(f"{op.name} takes {n} arguments, got {len(args)}")
    return args


def _checked_key(key: bytes) -> bytes:
    if not key or len(key) > MAX_KEY_BYTES:
        raise FrameError(f"a key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    return key
