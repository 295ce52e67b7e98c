"""The `Store` seam: the abstract key-value store every implementation (tcp, file, hash, prefix,
and elastic's etcd store) passes one contract suite for.

Public `Store` methods validate their input and normalise types, then call the private `_`
hooks that each implementation overrides. Semantics follow torch's c10d stores so scripts can
move between the two.
"""

from __future__ import annotations

from typing import Iterable, Sequence, Union

from shoal.collectives.types import DEFAULT_STORE_TIMEOUT_S
from shoal.core.timeouts import TimeoutLike, to_seconds

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 256 * 1024 * 1024

ValueLike = Union[bytes, bytearray, memoryview, str]


# ----------------------------------------------------------------------------- Store

def _key(key: str) -> str:
    if isinstance(key, bytes):
        key = key.decode()
    if not isinstance(key, str):
        raise TypeError(f"Store keys must be str, got {type(key).__name__}: {key!r}")
    if not key:
        raise ValueError("Store keys must be non-empty strings.")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(
            f"Store key of {len(key.encode())} bytes exceeds the {MAX_KEY_BYTES}-byte limit."
        )
    return key


def _value(value: ValueLike) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    elif isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise TypeError(f"Store values must be bytes or str, got {type(value).__name__}.")
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(
            f"Store value of {len(value)} bytes exceeds the {MAX_VALUE_BYTES}-byte limit."
        )
    return value


class Store:
    """A key-value store that ranks use to meet; values are bytes, counters are ASCII integers.

    `timeout` is the default for `get` and `wait`. `add` on a missing key starts from 0.
    `compare_set(key, expected, desired)` sets `desired` when the current value equals
    `expected` (or the key is missing and `expected` is empty) and returns the value now
    stored; on a missing key with non-empty `expected` it returns `expected`, as c10d does.
    """

    def __init__(self, timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT_S):
        self._timeout = to_seconds(timeout, DEFAULT_STORE_TIMEOUT_S)

    # -- public API (validation, then the private hook)

    @property
    def timeout(self) -> float:
        """Default timeout of `get` and `wait`, in seconds."""
        return self._timeout

    def set_timeout(self, timeout: TimeoutLike) -> None:
        """Change the default timeout."""
        self._timeout = to_seconds(timeout, DEFAULT_STORE_TIMEOUT_S)

    def set(self, key: str, value: ValueLike) -> None:
        """Store `value` under `key`, waking every waiter on it."""
        self._set(_key(key), _value(value))

    def get(self, key: str, timeout: TimeoutLike = None) -> bytes:
        """Return the value of `key`, waiting for it to be set up to the timeout.

        Raises:
            StoreTimeout: the key did not appear in time.
        """
        return self._get(_key(key), self._resolve(timeout))

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer under `key` and return the new value."""
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"Store.add amount must be an int, got {amount!r}.")
        return self._add(_key(key), amount)

    def compare_set(self, key: str, expected: ValueLike, desired: ValueLike) -> bytes:
        """Atomic compare-and-set; returns the value stored afterwards (see class doc)."""
        return self._compare_set(_key(key), _value(expected), _value(desired))

    def wait(self, keys: Sequence[str], timeout: TimeoutLike = None) -> None:
        """Block until every key in `keys` exists.

        Raises:
            StoreTimeout: naming the keys still missing after the timeout.
        """
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        self._wait([_key(k) for k in keys], self._resolve(timeout))

    def check(self, keys: Sequence[str]) -> bool:
        """True if every key in `keys` exists now (no waiting)."""
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        return self._check([_key(k) for k in keys])

    def delete(self, key: str) -> bool:
        """Remove `key`; True if it existed."""
        return self._delete(_key(key))

    def num_keys(self) -> int:
        """Number of keys stored."""
        return self._num_keys()

    def multi_get(self, keys: Sequence[str], timeout: TimeoutLike = None) -> list[bytes]:
        """`get` of several keys at once, waiting for all of them."""
        return self._multi_get([_key(k) for k in keys], self._resolve(timeout))

    def multi_set(self, keys: Sequence[str], values: Sequence[ValueLike]) -> None:
        """`set` of several keys at once (atomically where the backend allows)."""
        keys = list(keys)
        values = list(values)
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; they must pair up."
            )
        self._multi_set([_key(k) for k in keys], [_value(v) for v in values])

    # -- torch's further names

    def delete_key(self, key: str) -> bool:
        """torch's name of `delete`: remove `key`; True if it existed."""
        return self.delete(key)

    def append(self, key: str, value: ValueLike) -> None:
        """Append `value` to the bytes under `key` (setting it when missing), atomically."""
        key, value = _key(key), _value(value)
        self._append_value(key, value)

    def has_extended_api(self) -> bool:
        """True: append, multi_get and multi_set are there (torch asks before using them)."""
        return True

    def clone(self) -> "Store":
        """A second handle on the same data, safe to use from another thread (torch's clone).

        Raises:
            NotImplementedError: this store type cannot be cloned.
        """
        raise self._not_implemented("clone")

    def close(self) -> None:
        """Release connections and files; the store is unusable afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- helpers for implementations

    def _resolve(self, timeout: TimeoutLike) -> float:
        seconds = to_seconds(timeout)
        return self.timeout if seconds is None else seconds

    # -- private hooks (not abstract: a torch-style subclass that overrides the public
    # methods it needs is instantiable, and the others raise naming what is missing)

    def _not_implemented(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} does not implement {method}: this store type is not "
            f"implemented for it (override {method} or the private _{method} hook)."
        )

    def _set(self, key: str, value: bytes) -> None:
        raise self._not_implemented("set")

    def _get(self, key: str, timeout: float) -> bytes:
        raise self._not_implemented("get")

    def _add(self, key: str, amount: int) -> int:
        raise self._not_implemented("add")

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise self._not_implemented("compare_set")

    def _wait(self, keys: list[str], timeout: float) -> None:
        raise self._not_implemented("wait")

    def _check(self, keys: list[str]) -> bool:
        raise self._not_implemented("check")

    def _delete(self, key: str) -> bool:
        raise self._not_implemented("delete_key")

    def _num_keys(self) -> int:
        raise self._not_implemented("num_keys")

    def _append_value(self, key: str, value: bytes) -> None:
        # compare_set until no other writer came in between; stores with a native append
        # override this.
        while True:
            current = self._get(key, 0.0) if self._check([key]) else b""
            wanted = current + value
            if self._compare_set(key, current, wanted) == wanted:
                return

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        self._wait(keys, timeout)
        return [self._get(k, timeout) for k in keys]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for k, v in zip(keys, values):
            self._set(k, v)


def missing_keys_message(store_name: str, keys: Iterable[str], timeout: float) -> str:
    """The one wording every store uses for a wait that timed out."""
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:10]) + (" ..." if len(keys) > 10 else "")
    return f"{store_name} waited {timeout:g}s for {len(keys)} key(s) that never appeared: {shown}."
