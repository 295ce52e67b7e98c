"""`EtcdStore`: a collectives Store kept in etcd v3, for process groups formed over etcd.

Every key lives under a prefix (`/shoal/<run_id>/store/` for a run). `get` and `wait` watch a
missing key from the revision at which it was seen missing, so a set in between is never lost;
`add` and `compare_set` are transactions on the key's mod_revision, retried on conflict. Calls
fail over between endpoints and ride out short etcd outages (see `elastic.rendezvous.etcd_client`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional, Sequence, Union

import aetcd.exceptions as aexc

from shoal.collectives.store.rules import compare_set_outcome, not_an_integer
from shoal.collectives.store.api import Store, missing_keys_message
from shoal.collectives.types import StoreError, StoreTimeout
from shoal.core.timeouts import TimeoutLike
from shoal.elastic.rendezvous.etcd_client import EtcdClient
from shoal.elastic.rendezvous.etcd_secure import EtcdSecurity
from shoal.elastic.api import DEFAULT_BACKEND_TIMEOUT_S, RendezvousError

logger = logging.getLogger(__name__)

__all__ = ["EtcdStore"]


class EtcdStore(Store):
    """A Store over etcd: keys become `prefix + key`.

    Args:
        endpoints: 'host:port' strings, or one comma-separated string.
        prefix: the namespace, e.g. '/shoal/<run_id>/store/'.
        timeout: the default timeout of `get` and `wait`; also the deadline of every other
            call, retries across an etcd outage included.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        prefix: str,
        timeout: TimeoutLike = DEFAULT_BACKEND_TIMEOUT_S,
        security: Optional[EtcdSecurity] = None,
    ):
        super().__init__(timeout)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"EtcdStore prefix must be a non-empty string, got {prefix!r}.")
        self.prefix = prefix
        self._client = EtcdClient(endpoints, self.timeout, security)
        self._name = f"EtcdStore at {self._client.describe()} under {prefix!r}"

    def __repr__(self) -> str:
        return f"<{self._name}>"

    # ------------------------------------------------------------------ plumbing

    def _k(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _call(self, fn, op: str, timeout: Optional[float] = None):
        """Run `fn(client)` on the etcd loop; etcd failures become StoreError."""
        budget = self.timeout if timeout is None else timeout
        try:
            return self._client.call(fn, op, budget)
        except RendezvousError as exc:
            cause = exc.__cause__
            text = str(cause)
            if isinstance(cause, aexc.ClientError) and ("too large" in text
                                                         or "larger than max" in text):
                raise StoreError(
                    f"{self._name} refused {op}: the request is larger than etcd's "
                    "--max-request-bytes (1.5 MiB by default); raise it on the etcd server."
                ) from exc
            raise StoreError(f"{self._name} failed {op}: {exc}") from exc

    async def _missing(self, client, keys: list[str], deadline: float) -> list[str]:
        """Wait until every key exists or the deadline passes; return the keys still missing."""
        pending = list(keys)
        while pending:
            key = self._k(pending[0])
            found = await client.get_range(key, key + b"\0")
            if found.count:
                pending.pop(0)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                event = await client.watch_once(key, timeout=left,
                                                start_revision=found.header.revision + 1)
            except aexc.WatchTimeoutError:
                continue  # re-check once more, then report
            except aexc.RevisionCompactedError:
                continue
            if isinstance(event, Exception):
                await asyncio.sleep(0.05)  # the watch stream broke; re-read
        if not pending:
            return []
        # Report every missing key, not only the first one still waited on.
        missing = []
        for name in pending:
            key = self._k(name)
            found = await client.get_range(key, key + b"\0")
            if not found.count:
                missing.append(name)
        return missing

    def _wait_keys(self, keys: list[str], timeout: float, op: str) -> None:
        deadline = time.monotonic() + timeout  # fixed once: a retried attempt must not extend it

        async def wait(client):
            return await self._missing(client, keys, deadline)

        # The etcd budget covers the wait plus riding out an outage on top of it.
        missing = self._call(wait, op, timeout + self.timeout)
        if missing:
            raise StoreTimeout(missing_keys_message(self._name, missing, timeout))

    # ------------------------------------------------------------------ hooks

    def _set(self, key, value):
        self._call(lambda c: c.put(self._k(key), value), f"set of key {key!r}")

    def _get(self, key, timeout):
        self._wait_keys([key], timeout, f"get of key {key!r}")
        result = self._call(lambda c: c.get(self._k(key)), f"get of key {key!r}")
        if result is None:  # deleted between the wait and the read
            raise StoreTimeout(missing_keys_message(self._name, [key], timeout))
        return bytes(result.value)

    def _add(self, key, amount):
        k = self._k(key)

        async def add(client):
            t = client.transactions
            while True:
                current = await client.get(k)
                raw = b"0" if current is None else bytes(current.value)
                try:
                    value = int(raw) + amount
                except ValueError:
                    return raw, None
                compare = ([t.version(k) == 0] if current is None
                           else [t.mod(k) == current.mod_revision])
                ok, _ = await client.transaction(compare=compare,
                                                 success=[t.put(k, str(value).encode())],
                                                 failure=[])
                if ok:
                    return raw, value

        raw, value = self._call(add, f"add to key {key!r}")
        if value is None:
            raise ValueError(not_an_integer(key, raw))
        return value

    def _compare_set(self, key, expected, desired):
        k = self._k(key)

        async def cas(client):
            t = client.transactions
            while True:
                current = await client.get(k)
                swap, answer = compare_set_outcome(
                    None if current is None else bytes(current.value), expected, desired
                )
                if not swap:
                    return answer
                compare = ([t.version(k) == 0] if current is None
                           else [t.mod(k) == current.mod_revision])
                ok, _ = await client.transaction(compare=compare, success=[t.put(k, desired)],
                                                 failure=[])
                if ok:
                    return desired

        return self._call(cas, f"compare_set of key {key!r}")

    def _wait(self, keys, timeout):
        self._wait_keys(keys, timeout, f"wait for {len(keys)} key(s)")

    def _check(self, keys):
        async def check(client):
            for name in keys:
                key = self._k(name)
                found = await client.get_range(key, key + b"\0")
                if not found.count:
                    return False
            return True

        return self._call(check, f"check of {len(keys)} key(s)")

    def _delete(self, key):
        return self._call(lambda c: c.delete(self._k(key)), f"delete of key {key!r}") is not None

    def _num_keys(self):
        prefix = self.prefix.encode()
        result = self._call(lambda c: c.get_prefix(prefix, keys_only=True), "count of keys")
        return int(result.count)

    def _multi_get(self, keys, timeout):
        self._wait_keys(keys, timeout, f"multi_get of {len(keys)} key(s)")

        async def read(client):
            out = []
            for name in keys:
                found = await client.get(self._k(name))
                out.append(None if found is None else bytes(found.value))
            return out

        values = self._call(read, f"multi_get of {len(keys)} key(s)")
        gone = [k for k, v in zip(keys, values) if v is None]
        if gone:
            raise StoreTimeout(missing_keys_message(self._name, gone, timeout))
        return values

    def _multi_set(self, keys, values):
        if not keys:
            return

        async def put_all(client):
            t = client.transactions
            # One transaction: all keys appear at once (etcd limits a txn to 128 ops).
            for start in range(0, len(keys), 128):
                ops = [t.put(self._k(k), v) for k, v in zip(keys[start:start + 128],
                                                            values[start:start + 128])]
                await client.transaction(compare=[], success=ops, failure=[])

        self._call(put_all, f"multi_set of {len(keys)} key(s)")

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key that starts with `prefix` (under this store's own prefix); return
        how many there were. Used to drop a finished job's keys (see RendezvousHandler)."""
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"delete_prefix needs a non-empty prefix, got {prefix!r}.")
        result = self._call(lambda c: c.delete_prefix(self._k(prefix)),
                            f"delete of keys under {prefix!r}")
        return int(getattr(result, "deleted", 0))

    def bound_calls(self, until: Union[None, float, Callable[[], float]]) -> None:
        """End the calling thread's later etcd calls by `until` (see EtcdClient.bound_thread):
        an agent meeting its peers again gives an unreachable etcd only its outage budget."""
        self._client.bound_thread(until)

    def cap_calls(self, per_call: float, until: Optional[float] = None) -> None:
        """Bound every later etcd call (see EtcdClient.cap): the agent is finishing."""
        self._client.cap(per_call, until)

    def close(self) -> None:
        """Close the etcd channel."""
        self._client.close()
