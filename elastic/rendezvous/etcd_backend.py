"""`EtcdRendezvousBackend`: the rendezvous state in etcd v3, through aetcd.

Keys live under `/shoal/<run_id>/` (`--rdzv-conf etcd_prefix` names another root). The state
key is written by transaction, comparing its mod_revision with the token (the compare-and-set),
and is attached to the writer's lease. Every node keeps its own lease alive, and every
heartbeat rewrites the state, so the state lives as long as any node of the run does and
disappears `ttl` seconds after the last one is gone: a run id can be reused without finding a
stale round. `watch` is an etcd watch from the token's revision, so a change is seen at once
and none is missed.

A failed lease renewal is logged and retried; it never ends the job. etcd keeps leases across
its own restarts (and extends them when a leader is elected), so an outage shorter than `ttl`
costs nothing; if the lease did expire, a new one is granted and used from the next write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Sequence, Union

import aetcd.exceptions as aexc
import grpc
from aetcd import rpc

from shoal.core.timeouts import TimeoutLike, to_seconds
from shoal.elastic.rendezvous.etcd_client import EtcdClient, spawn
from shoal.elastic.rendezvous.etcd_secure import EtcdSecurity
from shoal.elastic.api import (
    DEFAULT_BACKEND_TIMEOUT_S,
    DEFAULT_ETCD_LEASE_TTL_S,
    RendezvousBackend,
    RendezvousError,
    Token,
    check_lease_ttl,
)

logger = logging.getLogger(__name__)

__all__ = ["EtcdRendezvousBackend"]


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state of one run in etcd, with a kept-alive lease and real watches.

    Args:
        endpoints: 'host:port' strings, or one comma-separated string; failed over in order.
        run_id: names the key prefix `<prefix>/<run_id>/`.
        ttl: the lease's time to live in seconds (renewed every ttl/3).
        timeout: the deadline of each etcd operation, retries included.
        security: TLS files and credentials (elastic.rendezvous.etcd_secure).
        prefix: where runs' keys live (`--rdzv-conf etcd_prefix`, as torch's etcd rendezvous).

    Raises:
        EtcdUnavailable: no endpoint answered while granting the lease.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        run_id: str,
        ttl: float = DEFAULT_ETCD_LEASE_TTL_S,
        timeout: TimeoutLike = DEFAULT_BACKEND_TIMEOUT_S,
        security: Optional[EtcdSecurity] = None,
        prefix: str = "/shoal",
    ):
        if not isinstance(run_id, str) or not run_id or "/" in run_id:
            raise ValueError(f"run_id must be a non-empty string without '/', got {run_id!r}.")
        self.run_id = run_id
        self.ttl = int(round(check_lease_ttl(ttl)))
        self.timeout = to_seconds(timeout, DEFAULT_BACKEND_TIMEOUT_S)
        self.prefix = f"{prefix.rstrip('/')}/{run_id}/"
        self.key = f"{self.prefix}rdzv/state".encode()
        self._client = EtcdClient(endpoints, self.timeout, security)
        self._lease_id: Optional[int] = None
        self._closed = False
        self._renewals_failed = 0
        try:
            self._lease_id = self._client.call(self._grant, "a lease grant")
        except BaseException:
            self._client.close()
            raise
        self._keepalive = spawn(self._keepalive_loop())

    @property
    def name(self) -> str:
        return "etcd"

    @property
    def state_key(self) -> str:
        """Where the state lives, for messages."""
        return f"etcd key {self.key.decode()!r}"

    @property
    def lease_id(self) -> Optional[int]:
        """The lease this node attaches its writes to."""
        return self._lease_id

    def lease_ttl(self) -> int:
        """Seconds the lease has left as etcd sees it (-1 once it expired)."""
        lease_id = self._lease_id
        info = self._client.call(lambda c: c.get_lease_info(lease_id, keys=False),
                                 "a lease lookup")
        return int(info.TTL)

    # ------------------------------------------------------------------ lease

    async def _grant(self, client) -> int:
        lease = await client.lease(self.ttl)
        return lease.id

    async def _renew(self, client, lease_id: int):
        """One keepalive round trip on a stream that is always cancelled afterwards.

        aetcd's refresh_lease leaves its stream to the garbage collector when it is interrupted
        (an etcd outage), which then warns about a pending task; owning the call avoids that.
        """
        await client.connect()
        call = client.leasestub.LeaseKeepAlive(timeout=self.ttl / 3.0, metadata=client.metadata)
        try:
            await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
            return await call.read()
        except rpc.AioRpcError as exc:
            if exc.code() in (rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED):
                raise aexc.ConnectionFailedError(exc.details()) from exc
            raise aexc.ClientError(exc.details()) from exc
        finally:
            call.cancel()

    async def _keepalive_loop(self) -> None:
        period = self.ttl / 3.0
        while not self._closed:
            await asyncio.sleep(period if self._renewals_failed == 0 else min(0.5, period))
            if self._closed:
                return
            lease_id = self._lease_id
            try:
                reply = await self._client.acall(
                    lambda c: self._renew(c, lease_id), "a lease renewal", timeout=period
                )
                if reply is None or reply is grpc.aio.EOF or reply.TTL <= 0:
                    logger.error(
                        "etcd lease %x of run %s expired; granting a new one (the state key "
                        "may have been deleted with it)", lease_id, self.run_id)
                    self._lease_id = await self._client.acall(self._grant, "a lease grant",
                                                              timeout=period)
                if self._renewals_failed:
                    logger.info("etcd lease %x of run %s renewed again after %d failed attempts",
                                self._lease_id, self.run_id, self._renewals_failed)
                self._renewals_failed = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (keep renewing whatever went wrong)
                self._renewals_failed += 1
                logger.warning("Renewing etcd lease %x of run %s failed (%d in a row), "
                               "retrying: %s", lease_id, self.run_id, self._renewals_failed, exc)

    # ------------------------------------------------------------------ state

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        result = self._client.call(lambda c: c.get(self.key), "a read of the rendezvous state")
        if result is None:
            return None
        return bytes(result.value), int(result.mod_revision)

    def set_state(
        self, state: bytes, token: Optional[Token] = None
    ) -> Optional[tuple[bytes, Token, bool]]:
        if not isinstance(state, (bytes, bytearray)):
            raise TypeError(f"Rendezvous state must be bytes, got {type(state).__name__}.")
        state = bytes(state)

        async def txn(client):
            t = client.transactions
            compare = [t.mod(self.key) == token] if token is not None else [t.version(self.key) == 0]
            return await client.transaction(
                compare=compare,
                success=[t.put(self.key, state, lease=self._lease_id), t.get(self.key)],
                failure=[t.get(self.key)],
            )

        succeeded, responses = self._client.call(txn, "a compare-and-set of the rendezvous state")
        kvs = responses[-1]
        if not kvs:
            return None
        value, kv = kvs[0]
        return bytes(value), int(kv.mod_revision), bool(succeeded)

    def watch(self, token: Optional[Token], timeout: TimeoutLike) -> None:
        seconds = to_seconds(timeout, 0.0)
        if seconds <= 0:
            return

        async def wait(client):
            start = None if token is None else token + 1
            if start is None:
                found = await client.get_range(self.key, self.key + b"\0")
                if found.count:
                    return  # the state exists now: it changed from "none"
                start = found.header.revision + 1
            try:
                event = await client.watch_once(self.key, timeout=seconds, start_revision=start)
            except aexc.WatchTimeoutError:
                return
            except aexc.RevisionCompactedError:
                return  # history compacted past our token: it certainly changed
            if isinstance(event, Exception):
                # The watch stream broke (etcd restarting): let the caller re-read, not spin.
                await asyncio.sleep(min(0.1, seconds))

        started = time.monotonic()
        try:
            self._client.call(wait, "a watch of the rendezvous state",
                              timeout=seconds + self.timeout)
        except RendezvousError:
            if time.monotonic() - started >= seconds:
                return
            raise

    def describe(self) -> str:
        return f"etcd at {self._client.describe()}"

    def bound_calls(self, until: Optional[float]) -> None:
        """End the calling thread's later etcd calls by `until` (time.monotonic(); None: no
        bound): a joining node gives an unreachable etcd only its outage budget."""
        self._client.bound_thread(until)

    def cap_calls(self, per_call: float, until: Optional[float] = None) -> None:
        """Bound every later etcd call (see EtcdClient.cap): the agent is finishing."""
        self._client.cap(per_call, until)

    def close(self) -> None:
        # The lease is left to expire, not revoked: the state key may hang on it while other
        # nodes still run.
        if self._closed:
            return
        self._closed = True
        self._keepalive.cancel()
        self._client.close()
