"""torch's c10d store seen as a `collectives.Store`, so a shoal group forms through the store
torch hands a backend (a PrefixStore over the job's TCPStore, FileStore or HashStore).

The store only carries addresses and progress; the connections the group then opens
authenticate every peer with the job's secret, as shoal's own groups do.
"""

from __future__ import annotations

import datetime
import threading
from typing import Callable, TypeVar

import torch.distributed as dist

from shoal.collectives.store.api import Store, missing_keys_message
from shoal.collectives.types import StoreError, StoreTimeout, StoreUnreachable

__all__ = ["TorchStore"]

T = TypeVar("T")


def _delta(seconds: float) -> datetime.timedelta:
    # torch reads a zero timeout as "use the store's default"; the shortest real wait is 1 ms.
    return datetime.timedelta(seconds=max(seconds, 0.001))


class TorchStore(Store):
    """A `collectives.Store` over a `torch.distributed.Store` (every call goes to torch's)."""

    def __init__(self, store: "dist.Store", timeout: float):
        super().__init__(timeout)
        self.torch_store = store
        self.host = _tcp_host(store)
        self._owner = threading.get_ident()
        self._local = threading.local()

    def _client(self) -> "dist.Store":
        """The torch store for this thread: torch's TCPStore client runs one call at a time,
        so a thread blocked in `wait` would hold up the watchdog's progress writes; every other
        thread gets its own connection (`clone`)."""
        if threading.get_ident() == self._owner:
            return self.torch_store
        client = getattr(self._local, "client", None)
        if client is None:
            try:
                client = self.torch_store.clone()
            except RuntimeError:  # a store type that cannot be cloned: share the one client
                client = self.torch_store
            self._local.client = client
        return client

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower() or "wait" in str(exc).lower():
                raise StoreTimeout(f"torch's store timed out in {what} of {key!r}: {exc}") from exc
            raise StoreError(f"torch's store failed in {what} of {key!r}: {exc}") from exc
        except (dist.DistNetworkError, ConnectionError) as exc:
            raise StoreUnreachable(
                f"torch's store could not be reached in {what} of {key!r} (the rank hosting it "
                f"may have died): {exc}"
            ) from exc
        except RuntimeError as exc:
            raise StoreError(f"torch's store failed in {what} of {key!r}: {exc}") from exc

    def _set(self, key: str, value: bytes) -> None:
        client = self._client()
        self._call("set", key, lambda: client.set(key, value))
        # torch's TCPStore sends a set without waiting for an answer, so a peer's check right
        # after it could miss the key (17 times in 20,000 here). The server answers one
        # connection's requests in order: a check on the same connection returns only once the
        # set is applied, which gives shoal's contract (a returned set is visible to everyone).
        self._call("set", key, lambda: client.check([key]))

    def _get(self, key: str, timeout: float) -> bytes:
        self._wait([key], timeout)
        return self._call("get", key, lambda: self._client().get(key))

    def _add(self, key: str, amount: int) -> int:
        # torch's TCPStore server drops a client whose add meets a non-integer value, and that
        # client's every later call fails: refuse such an add here, before it is sent.
        if self._check([key]):
            current = self._call("get", key, lambda: self._client().get(key))
            try:
                int(current)
            except ValueError:
                raise ValueError(
                    f"Store.add on key {key!r}, whose value {current!r} is not an integer."
                ) from None
        return self._call("add", key, lambda: self._client().add(key, amount))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", key,
                          lambda: self._client().compare_set(key, expected, desired))

    def _wait(self, keys: list[str], timeout: float) -> None:
        try:
            self._call("wait", ", ".join(keys),
                       lambda: self._client().wait(keys, _delta(timeout)))
        except StoreTimeout as exc:
            missing = [k for k in keys if not self._check([k])]
            raise StoreTimeout(missing_keys_message(self.name, missing or keys, timeout)) from exc

    @property
    def name(self) -> str:
        """How messages name this store: torch's store type (and its address)."""
        base = self.torch_store
        while isinstance(base, dist.PrefixStore):
            base = base.underlying_store
        where = f" at {base.host}:{base.port}" if isinstance(base, dist.TCPStore) else ""
        return f"torch {type(base).__name__}{where}"

    def _check(self, keys: list[str]) -> bool:
        return self._call("check", ", ".join(keys), lambda: self._client().check(keys))

    def _delete(self, key: str) -> bool:
        return self._call("delete_key", key, lambda: self._client().delete_key(key))

    def _num_keys(self) -> int:
        return self._call("num_keys", "*", lambda: self._client().num_keys())


def _tcp_host(store: "dist.Store") -> str | None:
    """The host of the TCPStore under any PrefixStores (where peers' routes point), or None."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store = store.underlying_store
        seen += 1
    return store.host if isinstance(store, dist.TCPStore) else None
