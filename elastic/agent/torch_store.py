"""torch's TCPStore protocol, server side, so that an unchanged torch script finds a store.

`torch.distributed.init_process_group(init_method="env://")` under an agent
(TORCHELASTIC_USE_AGENT_STORE=True) connects a C++ `TCPStore` client to MASTER_ADDR:MASTER_PORT
and speaks torch's own wire protocol there: no authentication, one command byte, then
little-endian fields (keys and values as a u64 length and the bytes). This module holds that
protocol's state (`TorchStoreState`) and one connection's parser (`TorchConnection`), with no
sockets: `agent.store_door` owns the listener and feeds bytes in.

The semantics follow torch 2.13's libuv server: a client proves nothing, but must send VALIDATE
with torch's magic number first; `get` of a missing key answers an empty value (the client
waits first); `add` keeps decimal text; `wait` parks until every key is set; `compare_set` of a
missing key with an empty expectation creates it. Frames are bounded by torch's own limits, so
a garbage length ends that connection instead of allocating it.
"""

from __future__ import annotations

import collections
import enum
import struct
from typing import Callable, Optional

# torch's c10d::detail constants (TCPStoreBackend.hpp, TCPStoreLibUvBackend.cpp).
VALIDATION_MAGIC = 0x3C85F7CE
MAX_KEY_COUNT = 128 * 1024
MAX_STRING_LEN = 8 * 1024
MAX_PAYLOAD_LEN = 8 * 1024 * 1024
# What one connection may send ahead of the server before it stops reading from it.
MAX_BUFFERED = 2 * MAX_PAYLOAD_LEN
# Keys and values held for torch's clients, in all: torch's own server has no bound, but the
# door answers anyone who reaches the port, and must not be made to exhaust the agent's memory.
MAX_HELD_BYTES = 1 << 30

_U8, _U32, _I64, _U64 = (struct.Struct(f) for f in ("<B", "<I", "<q", "<Q"))


class Query(enum.IntEnum):
    """torch's QueryType, in its order."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


READY, NOT_READY = 0, 1  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType


class ProtocolError(ValueError):
    """The peer sent something torch's client never sends; its connection is dropped."""


class _Incomplete(Exception):
    """Not enough bytes yet for the whole command."""


def _vector(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


class TorchStoreState:
    """The keys, queues and parked waits of one torch store; not thread-safe (one loop owns
    it)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, collections.deque] = collections.defaultdict(collections.deque)
        # key -> connections parked on it; connection -> keys it still waits for.
        self._waiting: dict[bytes, list["TorchConnection"]] = {}
        self._awaited: dict["TorchConnection", int] = {}
        # key -> connections in a barrier on it (torch's barrier lets everyone through once
        # its counter reaches the world size, and at once from then on).
        self._barriers: dict[bytes, list["TorchConnection"]] = {}
        self.held = 0  # bytes of keys and values held (data and queues)

    def hold(self, added: int, released: int = 0) -> None:
        """Account for a change of `added - released` bytes; refuse one over MAX_HELD_BYTES."""
        if self.held + added - released > MAX_HELD_BYTES:
            raise ProtocolError(f"the store would hold more than {MAX_HELD_BYTES} bytes of keys "
                                "and values")
        self.held += added - released

    def ready(self, keys: list[bytes]) -> bool:
        """Every key is set (or names a non-empty queue)."""
        return all(k in self.data or self.queues.get(k) for k in keys)

    def park(self, conn: "TorchConnection", keys: list[bytes]) -> bool:
        """Park `conn` until `keys` are set; True when they already are."""
        if self.ready(keys):
            return True
        missing = [k for k in keys if k not in self.data]
        for key in missing:
            self._waiting.setdefault(key, []).append(conn)
        self._awaited[conn] = len(missing)
        return False

    def barrier(self, conn: "TorchConnection", key: bytes, world: int) -> bool:
        """`conn` arrives at the barrier counted at `key`; True when it may pass now (it is
        parked otherwise, and answered when the last one arrives)."""
        if self.add(key, 1) < world:
            self._barriers.setdefault(key, []).append(conn)
            return False
        for parked in self._barriers.pop(key, []):
            parked.send(_U8.pack(STOP_WAITING))
        return True

    def forget(self, conn: "TorchConnection") -> None:
        """Drop every wait of `conn` (cancelled, or the connection closed)."""
        for key in [k for k, conns in self._barriers.items() if conn in conns]:
            self._barriers[key] = [c for c in self._barriers[key] if c is not conn]
        if self._awaited.pop(conn, None) is None:
            return
        for key in list(self._waiting):
            parked = [c for c in self._waiting[key] if c is not conn]
            if parked:
                self._waiting[key] = parked
            else:
                del self._waiting[key]

    def wake(self, key: bytes, only_one: bool = False) -> None:
        """Answer the waits that `key` completes (one of them for a queue push)."""
        parked = self._waiting.get(key)
        if not parked:
            return
        for conn in list(parked):
            left = self._awaited.get(conn, 0) - 1
            self._awaited[conn] = left
            parked.remove(conn)
            if left == 0:
                del self._awaited[conn]
                conn.send(_U8.pack(STOP_WAITING))
                if only_one:
                    break
        if not parked:
            self._waiting.pop(key, None)

    def set(self, key: bytes, value: bytes) -> None:
        """Set `key` and wake its waits."""
        old = self.data.get(key)
        self.hold(len(key) + len(value), 0 if old is None else len(key) + len(old))
        self.data[key] = value
        self.wake(key)

    def delete(self, key: bytes) -> bool:
        """Remove `key`; True if it was set."""
        old = self.data.pop(key, None)
        if old is None:
            return False
        self.held -= len(key) + len(old)
        return True

    def push(self, key: bytes, value: bytes) -> None:
        """Append `value` to the queue `key` and wake one of its waits."""
        self.hold(len(key) + len(value))
        self.queues[key].append(value)
        self.wake(key, only_one=True)

    def pop(self, key: bytes) -> Optional[bytes]:
        """The head of the queue `key`, removed; None when it is empty."""
        queue = self.queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        self.held -= len(key) + len(value)
        return value

    def add(self, key: bytes, delta: int) -> int:
        """Add `delta` to the decimal number stored at `key` (0 when missing)."""
        old = self.data.get(key)
        try:
            total = delta + (int(old) if old is not None else 0)
        except ValueError as exc:
            raise ProtocolError(f"add on key {key!r} whose value {old[:32]!r} is not a "
                                "number") from exc
        self.set(key, str(total).encode())
        return total


class TorchConnection:
    """One torch client: bytes in (`feed`), replies out through `send`; raises ProtocolError
    on a command torch's client never sends."""

    def __init__(self, state: TorchStoreState, send: Callable[[bytes], None]):
        self._state = state
        self.send = send
        self._buf = bytearray()
        self._pos = 0
        self.validated = False

    def feed(self, data: bytes) -> None:
        """Take bytes from the client and run every whole command they complete."""
        self._buf += data
        if len(self._buf) > MAX_BUFFERED:
            raise ProtocolError(f"the client sent more than {MAX_BUFFERED} bytes that form "
                                "no whole command")
        while self._buf:
            self._pos = 0
            try:
                self._one()
            except _Incomplete:
                return
            del self._buf[:self._pos]

    def close(self) -> None:
        """The connection is gone: drop its parked waits."""
        self._state.forget(self)

    # ------------------------------------------------------------------ reading fields

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise _Incomplete
        out = bytes(self._buf[self._pos:end])
        self._pos = end
        return out

    def _u(self, fmt: struct.Struct) -> int:
        return fmt.unpack(self._take(fmt.size))[0]

    def _bytes(self, limit: int, what: str) -> bytes:
        size = self._u(_U64)
        if size > limit:
            raise ProtocolError(f"a {what} of {size} bytes is over torch's limit of {limit}")
        return self._take(size)

    def _key(self) -> bytes:
        return self._bytes(MAX_STRING_LEN, "key")

    def _value(self) -> bytes:
        return self._bytes(MAX_PAYLOAD_LEN, "value")

    def _count(self) -> int:
        count = self._u(_U64)
        if count > MAX_KEY_COUNT:
            raise ProtocolError(f"{count} keys in one command, over torch's limit of "
                                f"{MAX_KEY_COUNT}")
        return count

    def _keys(self) -> list[bytes]:
        return [self._key() for _ in range(self._count())]

    # ------------------------------------------------------------------ commands

    def _one(self) -> None:
        code = self._u(_U8)
        try:
            query = Query(code)
        except ValueError as exc:
            raise ProtocolError(f"unknown command byte {code}") from exc
        if not self.validated:
            if query is not Query.VALIDATE:
                raise ProtocolError(f"{query.name} before VALIDATE")
        reply = getattr(self, _HANDLERS[query])()
        if reply is not None:
            self.send(reply)

    def _validate(self) -> None:
        magic = self._u(_U32)
        if magic != VALIDATION_MAGIC:
            raise ProtocolError(f"VALIDATE with {magic:#x}, not torch's magic number")
        self.validated = True

    def _ping(self) -> bytes:
        return _U32.pack(self._u(_U32))

    def _set(self) -> None:
        key, value = self._key(), self._value()
        self._state.set(key, value)

    def _compare_set(self) -> bytes:
        key, expected, desired = self._key(), self._value(), self._value()
        state = self._state
        current = state.data.get(key)
        if current is None:
            if expected:
                state.wake(key)
                return _vector(expected)  # torch answers the expectation for a missing key
            state.set(key, desired)
            return _vector(desired)
        if current == expected:
            state.set(key, desired)  # wakes its waits
            return _vector(desired)
        state.wake(key)
        return _vector(current)

    def _get(self) -> bytes:
        return _vector(self._state.data.get(self._key(), b""))

    def _add(self) -> bytes:
        key, delta = self._key(), self._u(_I64)
        return _I64.pack(self._state.add(key, delta))

    def _check(self) -> bytes:
        return _U8.pack(READY if self._state.ready(self._keys()) else NOT_READY)

    def _wait(self) -> Optional[bytes]:
        return _U8.pack(STOP_WAITING) if self._state.park(self, self._keys()) else None

    def _num_keys(self) -> bytes:
        return _I64.pack(len(self._state.data))

    def _delete(self) -> bytes:
        return _I64.pack(1 if self._state.delete(self._key()) else 0)

    def _append(self) -> None:
        key, value = self._key(), self._value()
        self._state.set(key, self._state.data.get(key, b"") + value)

    def _multi_get(self) -> bytes:
        return b"".join(_vector(self._state.data.get(k, b"")) for k in self._keys())

    def _multi_set(self) -> None:
        pairs = [(self._key(), self._value()) for _ in range(self._count())]
        for key, value in pairs:
            self._state.set(key, value)

    def _cancel_wait(self) -> bytes:
        self._state.forget(self)
        return _U8.pack(WAIT_CANCELED)

    def _queue_push(self) -> None:
        key, value = self._key(), self._value()
        self._state.push(key, value)

    def _queue_pop(self) -> bytes:
        key = self._key()
        queue = self._state.queues.get(key)
        head = _I64.pack(len(queue) if queue else 0)
        value = self._state.pop(key)
        return head if value is None else head + _vector(value)

    def _queue_len(self) -> bytes:
        queue = self._state.queues.get(self._key())
        return _I64.pack(len(queue) if queue else 0)

    def _list_keys(self) -> bytes:
        keys = list(self._state.data)
        return _I64.pack(len(keys)) + b"".join(_vector(k) for k in keys)

    def _barrier(self) -> Optional[bytes]:
        key, world = self._key(), self._u(_I64)
        return _U8.pack(STOP_WAITING) if self._state.barrier(self, key, world) else None


# Each command's handler, by method name.
_HANDLERS = {
    Query.VALIDATE: "_validate",
    Query.PING: "_ping",
    Query.SET: "_set",
    Query.COMPARE_SET: "_compare_set",
    Query.GET: "_get",
    Query.ADD: "_add",
    Query.CHECK: "_check",
    Query.WAIT: "_wait",
    Query.GETNUMKEYS: "_num_keys",
    Query.DELETE_KEY: "_delete",
    Query.APPEND: "_append",
    Query.MULTI_GET: "_multi_get",
    Query.MULTI_SET: "_multi_set",
    Query.CANCEL_WAIT: "_cancel_wait",
    Query.QUEUE_PUSH: "_queue_push",
    Query.QUEUE_POP: "_queue_pop",
    Query.QUEUE_LEN: "_queue_len",
    Query.LIST_KEYS: "_list_keys",
    Query.BARRIER: "_barrier",
}
