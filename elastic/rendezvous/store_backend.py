"""`StoreRendezvousBackend`: the rendezvous state in any collectives Store (TCPStore by default).

The stored value is `b"<version> <nonce>\\n" + state`. The token is the whole stored value, so
`Store.compare_set` is the compare-and-set. The random nonce makes every write distinct, so two
writers racing from one token with identical states cannot both believe they won (compare_set
only returns the value now stored). The version names a "changed/<version>" key that `watch`
waits on, since a Store can wait for a key to appear but cannot report that one changed.
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import Optional

from shoal.collectives.store.api import Store
from shoal.collectives.types import StoreError, StoreTimeout
from shoal.core.timeouts import TimeoutLike, to_seconds
from shoal.elastic.api import RendezvousBackend, RendezvousError, RendezvousStateError, Token

logger = logging.getLogger(__name__)

# How many "changed/<version>" markers stay behind the newest; older ones are deleted so a
# long job does not grow the store by one key per heartbeat.
_KEEP_MARKERS = 64


_HEAD = re.compile(rb"(\d+) [0-9a-f]+")


def _split(stored: bytes, key: str) -> tuple[int, bytes]:
    head, sep, state = stored.partition(b"\n")
    match = _HEAD.fullmatch(head) if sep else None
    if match is None:
        raise RendezvousStateError(
            f"The rendezvous state under store key {key!r} does not start with a version line "
            f"(it begins {stored[:32]!r}); another program may have written it."
        )
    return int(match.group(1)), state


class StoreRendezvousBackend(RendezvousBackend):
    """Keeps one run's rendezvous state under `shoal/rdzv/<run_id>/` in `store`."""

    def __init__(self, store: Store, run_id: str, timeout: TimeoutLike = 10.0):
        if not isinstance(store, Store):
            raise TypeError(f"StoreRendezvousBackend needs a collectives Store, got {store!r}.")
        if not isinstance(run_id, str) or not run_id or "/" in run_id:
            raise ValueError(f"run_id must be a non-empty string without '/', got {run_id!r}.")
        self._store = store
        self._run_id = run_id
        self._timeout = to_seconds(timeout, 10.0)
        self._prefix = f"shoal/rdzv/{run_id}"
        self._key = f"{self._prefix}/state"

    @property
    def name(self) -> str:
        return "store"

    @property
    def state_key(self) -> str:
        """Where the state lives, for messages."""
        return f"store key {self._key!r}"

    @property
    def store(self) -> Store:
        """The store the state lives in."""
        return self._store

    def _marker(self, version: int) -> str:
        return f"{self._prefix}/changed/{version}"

    def _fail(self, op: str, exc: Exception) -> RendezvousError:
        return RendezvousError(
            f"The store rendezvous backend of run {self._run_id!r} failed to {op} "
            f"key {self._key!r}: {exc}"
        )

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        try:
            if not self._store.check([self._key]):
                return None
            stored = self._store.get(self._key, self._timeout)
        except StoreError as exc:
            raise self._fail("read", exc) from exc
        return _split(stored, self._key)[1], stored

    def set_state(
        self, state: bytes, token: Optional[Token] = None
    ) -> Optional[tuple[bytes, Token, bool]]:
        if not isinstance(state, (bytes, bytearray)):
            raise TypeError(f"Rendezvous state must be bytes, got {type(state).__name__}.")
        version = 0 if token is None else _split(token, self._key)[0]
        desired = b"%d %s\n" % (version + 1, secrets.token_hex(8).encode()) + bytes(state)
        # A missing key compares equal to b"" (see Store.compare_set).
        expected = b"" if token is None else token
        try:
            current = self._store.compare_set(self._key, expected, desired)
        except StoreError as exc:
            raise self._fail("compare-and-set", exc) from exc
        if token is not None and current == expected:
            # compare_set returns `expected` only for a key that did not exist (a key holding
            # `expected` would now hold `desired`), so the state vanished. Checking the key
            # again would race with a node recreating it, and answering with `expected` then
            # handed the caller the vanished state as if it were current.
            return None
        written = current == desired
        if written:
            self._announce(version + 1)
        return _split(current, self._key)[1], current, written

    def _announce(self, version: int) -> None:
        try:
            self._store.set(self._marker(version), b"1")
            if version > _KEEP_MARKERS:
                self._store.delete(self._marker(version - _KEEP_MARKERS))
        except StoreError as exc:
            # Watchers then fall back to their timeout; the state itself is written.
            logger.warning("Could not mark rendezvous state version %s as changed: %s", version, exc)

    def watch(self, token: Optional[Token], timeout: TimeoutLike) -> None:
        seconds = to_seconds(timeout, 0.0)
        current = self.get_state()
        if (None if current is None else current[1]) != token:
            return
        version = 0 if token is None else _split(token, self._key)[0]
        try:
            self._store.wait([self._marker(version + 1)], seconds)
        except StoreTimeout:
            return
        except StoreError as exc:
            raise self._fail("watch", exc) from exc
