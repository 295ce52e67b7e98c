"""`HashStore`: an in-process store (threads of one process), the reference implementation."""

from __future__ import annotations

import threading
import time

from shoal.collectives.store.rules import added, compare_set_outcome
from shoal.collectives.store.api import Store, missing_keys_message
from shoal.collectives.types import StoreTimeout
from shoal.core.timeouts import TimeoutLike


class HashStore(Store):
    """A dict guarded by one condition variable; waiters sleep until a set wakes them."""

    def __init__(self, timeout: TimeoutLike = None):
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def clone(self) -> "HashStore":
        """This store itself: its data lives in this process and is thread-safe already."""
        return self

    def _append_value(self, key, value):
        with self._cond:
            self._data[key] = self._data.get(key, b"") + value
            self._cond.notify_all()

    def _set(self, key, value):
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _wait_locked(self, keys, timeout):
        end = time.monotonic() + timeout
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            left = end - time.monotonic()
            if left <= 0:
                raise StoreTimeout(missing_keys_message("HashStore", missing, timeout))
            self._cond.wait(left)

    def _get(self, key, timeout):
        with self._cond:
            self._wait_locked([key], timeout)
            return self._data[key]

    def _add(self, key, amount):
        with self._cond:
            value = added(key, self._data.get(key, b"0"), amount)
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def _compare_set(self, key, expected, desired):
        with self._cond:
            swap, answer = compare_set_outcome(self._data.get(key), expected, desired)
            if swap:
                self._data[key] = desired
                self._cond.notify_all()
            return answer

    def _wait(self, keys, timeout):
        with self._cond:
            self._wait_locked(keys, timeout)

    def _check(self, keys):
        with self._cond:
            return all(k in self._data for k in keys)

    def _delete(self, key):
        with self._cond:
            return self._data.pop(key, None) is not None

    def _num_keys(self):
        with self._cond:
            return len(self._data)

    def _multi_get(self, keys, timeout):
        with self._cond:
            self._wait_locked(keys, timeout)
            return [self._data[k] for k in keys]

    def _multi_set(self, keys, values):
        with self._cond:
            self._data.update(zip(keys, values))
            self._cond.notify_all()
