"""`PrefixStore`: a namespace inside another store, so groups and rounds never collide."""

from __future__ import annotations

from shoal.collectives.store.api import Store


class PrefixStore(Store):
    """Every key becomes `prefix + "/" + key` in the underlying store."""

    def __init__(self, prefix: str, store: Store):
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps a Store, got {type(store).__name__}.")
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be a str, got {prefix!r}.")
        super().__init__(store.timeout)
        self.prefix = prefix
        self.underlying_store = store

    def clone(self) -> "PrefixStore":
        """The same prefix over a clone of the underlying store."""
        return PrefixStore(self.prefix, self.underlying_store.clone())

    def _append_value(self, key, value):
        self.underlying_store.append(self._k(key), value)

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    @property
    def timeout(self) -> float:
        return self.underlying_store.timeout

    def set_timeout(self, timeout) -> None:
        self.underlying_store.set_timeout(timeout)

    def _set(self, key, value):
        self.underlying_store.set(self._k(key), value)

    def _get(self, key, timeout):
        return self.underlying_store.get(self._k(key), timeout)

    def _add(self, key, amount):
        return self.underlying_store.add(self._k(key), amount)

    def _compare_set(self, key, expected, desired):
        return self.underlying_store.compare_set(self._k(key), expected, desired)

    def _wait(self, keys, timeout):
        self.underlying_store.wait([self._k(k) for k in keys], timeout)

    def _check(self, keys):
        return self.underlying_store.check([self._k(k) for k in keys])

    def _delete(self, key):
        return self.underlying_store.delete(self._k(key))

    def _num_keys(self):
        # c10d counts the whole underlying store too: a prefix has no cheap key listing.
        return self.underlying_store.num_keys()

    def _multi_get(self, keys, timeout):
        return self.underlying_store.multi_get([self._k(k) for k in keys], timeout)

    def _multi_set(self, keys, values):
        self.underlying_store.multi_set([self._k(k) for k in keys], values)
