"""MACs under the job's secret on everything the agents read back from the rendezvous backend.

etcd is shared: whoever can write to it could otherwise steer a job (plant a master store
address, close the rendezvous so that every node exits 0 with the work undone). So the
rendezvous state carries a MAC over its canonical JSON, bound to the run id, and every value the
agents keep in the run's store (the round's master address and worker counts, the restart
ledger's records, the exit barrier) is stored as `MAGIC + MAC + value`, the MAC bound to the
run id and the value's full key, so a value cannot be moved to another key or run. A value that
fails its MAC is an attack (or a job with another secret under the same run id): reading it
raises `ForgedValueError` naming the key, and the handler stops rather than act on it. An etcd
writer can therefore stop a job, never steer it or make it report success.

Not covered: `add` counters (the restart count, the exit barrier's arrivals, the goodbyes of a
finished job) are server-side integers that no MAC can follow. Changing one can end a job early
(restarts used up) or keep a failing job restarting, never lead a node to another address; the
exit barrier's `exit_done` marker, which lets a node report success, is a signed value.
Replaying an older genuine state of the same run is possible; it reopens or repeats rounds (the
job restarts from its checkpoint), and a genuine close replayed into a running round makes the
node exit non-zero (see `elastic.agent`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Optional

from shoal.collectives.store.api import Store
from shoal.collectives.types import StoreError
from shoal.core import auth
from shoal.elastic.api import RendezvousStateError

logger = logging.getLogger(__name__)

__all__ = ["ForgedValueError", "Seal", "SignedStore"]

MAGIC = b"SHV1"
_MAC_BYTES = hashlib.sha256().digest_size


class ForgedValueError(RendezvousStateError, StoreError):
    """A value read from the rendezvous backend fails its MAC under the job's secret; the
    message names the key. A StoreError too, so a store's callers see it as a failed read."""


class Seal:
    """The job's MACs for one run: over the rendezvous state and over store values."""

    def __init__(self, secret: bytes, run_id: str):
        if not secret:
            raise ValueError("A rendezvous seal needs the job's non-empty secret.")
        self._secret = bytes(secret)
        self.run_id = run_id

    def state_mac(self, payload: bytes) -> str:
        """Hex MAC of the state's canonical JSON (without its mac field)."""
        return auth.sign(self._secret, f"shoal-rdzv-state/{self.run_id}", payload).hex()

    def check_state(self, payload: bytes, mac: object, where: str) -> None:
        """Raise ForgedValueError unless `mac` is the state's MAC."""
        if not isinstance(mac, str) or not hmac.compare_digest(self.state_mac(payload), mac):
            raise ForgedValueError(forged_message(where, self.run_id, "rendezvous state"))

    def _value_mac(self, key: str, value: bytes) -> bytes:
        return auth.sign(self._secret, f"shoal-rdzv-store/{self.run_id}",
                         key.encode() + b"\0" + value)

    def seal_value(self, key: str, value: bytes) -> bytes:
        """`value` as stored under `key`: magic, MAC, value."""
        return MAGIC + self._value_mac(key, value) + value

    def open_value(self, key: str, stored: bytes, where: str) -> bytes:
        """The value stored under `key`, checked.

        Raises:
            ForgedValueError: no magic or a wrong MAC.
        """
        stored = bytes(stored)
        head = len(MAGIC) + _MAC_BYTES
        value = stored[head:]
        if (len(stored) < head or not stored.startswith(MAGIC)
                or not hmac.compare_digest(stored[len(MAGIC):head], self._value_mac(key, value))):
            raise ForgedValueError(forged_message(where, self.run_id, "value"))
        return value


def forged_message(where: str, run_id: str, what: str) -> str:
    """The one sentence for a value that fails its MAC."""
    return (f"The {what} at {where} fails its MAC under this job's secret, so it was not "
            f"written by a node of run {run_id!r}: someone who can write to the rendezvous "
            "backend forged it, or a job with another secret uses the same run id. This node "
            "stops rather than act on it.")


class SignedStore(Store):
    """Keys `prefix/key` of `store`, each value sealed with the job's MAC (see module doc).

    Args:
        store: the run's store (etcd, or the embedded TCPStore).
        prefix: the namespace inside it (the job's or the round's).
        seal: the job's MACs.
        on_forged: called with the error before a forged value is reported (the handler
            aborts, so that nothing else acts on the backend's contents).
    """

    def __init__(self, store: Store, prefix: str, seal: Seal, on_forged=None):
        super().__init__(store.timeout)
        self.underlying_store = store
        self.prefix = prefix
        self._seal = seal
        self._on_forged = on_forged

    def __repr__(self) -> str:
        return f"<SignedStore {self.prefix!r} in {self.underlying_store!r}>"

    @property
    def timeout(self) -> float:
        return self.underlying_store.timeout

    def set_timeout(self, timeout) -> None:
        self.underlying_store.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _open(self, key: str, stored: bytes) -> bytes:
        full = self._k(key)
        try:
            return self._seal.open_value(full, stored, f"store key {full!r}")
        except ForgedValueError as exc:
            if self._on_forged is not None:
                self._on_forged(exc)  # it logs the error once
            else:
                logger.error("%s", exc)
            raise

    def _set(self, key, value):
        self.underlying_store.set(self._k(key), self._seal.seal_value(self._k(key), value))

    def _get(self, key, timeout):
        return self._open(key, self.underlying_store.get(self._k(key), timeout))

    def _add(self, key, amount):
        # A counter is the server's integer: it cannot carry a MAC (see the module doc).
        return self.underlying_store.add(self._k(key), amount)

    def _compare_set(self, key, expected, desired):
        full = self._k(key)
        # The MAC is deterministic, so a sealed `expected` equals what a peer stored.
        sealed_expected = self._seal.seal_value(full, expected) if expected else b""
        answer = self.underlying_store.compare_set(full, sealed_expected,
                                                   self._seal.seal_value(full, desired))
        return self._open(key, answer) if answer else answer

    def _verified(self, keys: list[str], timeout: float) -> list[bytes]:
        stored = self.underlying_store.multi_get([self._k(k) for k in keys], timeout)
        return [self._open(k, v) for k, v in zip(keys, stored)]

    def _wait(self, keys, timeout):
        # Existence alone proves nothing (an etcd writer can create any key): read them too.
        self.underlying_store.wait([self._k(k) for k in keys], timeout)
        self._verified(keys, timeout)

    def _check(self, keys):
        if not self.underlying_store.check([self._k(k) for k in keys]):
            return False
        self._verified(keys, self.timeout)
        return True

    def _delete(self, key):
        return self.underlying_store.delete(self._k(key))

    def _num_keys(self):
        return self.underlying_store.num_keys()

    def _multi_get(self, keys, timeout):
        return self._verified(keys, timeout)

    def _multi_set(self, keys, values):
        sealed = [self._seal.seal_value(self._k(k), v) for k, v in zip(keys, values)]
        self.underlying_store.multi_set([self._k(k) for k in keys], sealed)


def job_secret(secret: Optional[bytes]) -> bytes:
    """`secret`, else the process's (SHOAL_AUTH_TOKEN, which `shoal run` sets before it builds
    its rendezvous, or SHOAL_AUTH_TOKEN_FILE; the development token on one machine)."""
    return bytes(secret) if secret is not None else auth.load_token()
