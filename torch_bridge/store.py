"""torch's c10d store seen as a `collectives.Store`, so a shoal group forms through the store
torch hands a backend (a PrefixStore over the job's TCPStore, FileStore or HashStore).

The store only carries addresses and progress; the connections the group then opens
authenticate every peer with the job's secret, as shoal's own groups do.
"""

from __future__ import annotations

import datetime
from typing import Callable, TypeVar

import torch.distributed as dist

from shoal.collectives.store.api import Store
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
        self._call("set", key, lambda: self.torch_store.set(key, value))

    def _get(self, key: str, timeout: float) -> bytes:
        self._wait([key], timeout)
        return self._call("get", key, lambda: self.torch_store.get(key))

    def _add(self, key: str, amount: int) -> int:
        return self._call("add", key, lambda: self.torch_store.add(key, amount))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", key,
                          lambda: self.torch_store.compare_set(key, expected, desired))

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._call("wait", ", ".join(keys), lambda: self.torch_store.wait(keys, _delta(timeout)))

    def _check(self, keys: list[str]) -> bool:
        return self._call("check", ", ".join(keys), lambda: self.torch_store.check(keys))

    def _delete(self, key: str) -> bool:
        return self._call("delete_key", key, lambda: self.torch_store.delete_key(key))

    def _num_keys(self) -> int:
        return self._call("num_keys", "*", self.torch_store.num_keys)


def _tcp_host(store: "dist.Store") -> str | None:
    """The host of the TCPStore under any PrefixStores (where peers' routes point), or None."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store = store.underlying_store
        seen += 1
    return store.host if isinstance(store, dist.TCPStore) else None
