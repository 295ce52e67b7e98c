"""Abstract seams of the elastic layer: the rendezvous backend, its settings and result, errors.

The rendezvous state machine (`elastic.rendezvous.RendezvousHandler`) sits above one small
`RendezvousBackend` with three members, as in torch.distributed.elastic: `get_state`,
`set_state` (a compare-and-set on an opaque token) and an optional `watch`. Backends are named
by kind: `rendezvous.etcd_backend.EtcdRendezvousBackend` (etcd v3) and
`rendezvous.store_backend.StoreRendezvousBackend` (any collectives Store, the embedded TCPStore
by default); `rendezvous.registry.BACKENDS` is the one list of them.

The handler in `elastic.rendezvous.handler` (its rules in `rendezvous.decisions`), the
factories in `elastic.rendezvous.registry` (both importable from `elastic.rendezvous` and
`elastic`):

    create_backend(name: "store" | "etcd", endpoints: str | list[str] | None, run_id: str, *,
                   store: Store | None = None, is_host: bool = False,
                   timeout: float = DEFAULT_BACKEND_TIMEOUT_S, **options)
        -> tuple[RendezvousBackend, Store]
        "store": over `store` if given, else a TCPStore at endpoint "HOST:PORT" (hosted here
        when is_host, port 0 allowed: read the bound port from `store.port`).
        "etcd": endpoints "h:p,h:p" or a list; the Store is an `EtcdStore` under
        /shoal/<run_id>/store/. options: ttl (lease seconds) for etcd.
    create_handler(name, endpoints, settings, node_id, **same keywords) -> RendezvousHandler
        (the handler owns and closes its backend and store on shutdown()).

    RendezvousHandler(backend, settings, node_id: str, store: Store, *, owns=False,
                      backend_timeout=DEFAULT_BACKEND_TIMEOUT_S, secret: bytes | None = None)
        secret: the job's secret, which MACs the rendezvous state and the job's store values
        (`rendezvous.sealing`; a forged or altered value is refused, naming its key); every
        node of the job needs the same one. Default: SHOAL_AUTH_TOKEN (or
        SHOAL_AUTH_TOKEN_FILE), which `shoal run` sets; without either, shoal's development
        token, fit only for a job on one host's loopback (anyone who can write to etcd could
        forge what the job reads; core.auth refuses it with a non-loopback MASTER_ADDR).
        .next_rendezvous() -> RendezvousInfo      join the next round (rounds count from 0)
        .meet_again()                             the round is over: the calls from here to
                                                  the next join share its join_outage_timeout
        .num_nodes_waiting() -> int               alive nodes waiting to join a running round
        .signal_restart(reason: str)              every agent's restart_requested() sees it
        .restart_requested() -> Optional[str]     why this node's round must end, or None
        .dead_nodes() -> list[str]                participants whose heartbeat lapsed
        .is_closed() -> bool / .set_closed()      closing ends the job everywhere
        .shutdown()                               leave the rendezvous, stop heartbeats
        .node_id, .settings, .backend, .store, .round (last joined round or None)
        .job_store                                the store scoped to the joined job's
                                                  generation (a new job under a used run id
                                                  never sees the old job's keys)
"""

from __future__ import annotations

import abc
import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

from shoal.core.errors import ShoalError
from shoal.core.timeouts import TimeoutLike, to_seconds

if TYPE_CHECKING:  # annotations only: the launcher reads the settings here without collectives
    from shoal.collectives.store.api import Store

# Defaults, in seconds, of every rendezvous setting (one table for the package).
DEFAULT_LAST_CALL_TIMEOUT_S = 2.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
DEFAULT_ETCD_LEASE_TTL_S = 30.0
DEFAULT_BACKEND_TIMEOUT_S = 10.0
DEFAULT_MASTER_TIMEOUT_S = 60.0
# How long a joining node waits for an unreachable etcd or store before it gives up: long
# enough to ride out an etcd restart or leader election (seconds), short enough that a dead
# backend reads as an error and not as a hang of the whole join timeout.
DEFAULT_JOIN_OUTAGE_TIMEOUT_S = 60.0
JOIN_OUTAGE_TIMEOUT_RANGE_S = (1.0, 3600.0)

# A backend's opaque version of the state (an etcd mod_revision, a store's stored bytes).
Token = Any

MASTER_KEY = "master_addr_port"


# ----------------------------------------------------------------------------- errors

class RendezvousError(ShoalError, RuntimeError):
    """A rendezvous failed: backend unreachable, bad state, bad settings."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous was closed (the job is over everywhere); no new round can start."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """A round did not complete within the join timeout; the message names who had joined."""


class StoreHostLostError(RendezvousError):
    """The node hosting the run's store died; the message names it and its address."""


class RendezvousUnreachableError(RendezvousError):
    """The backend stayed unreachable for join_outage_timeout while a node was joining; the
    message names the endpoint, how long it was away and what the node waited for."""


class RendezvousStateError(RendezvousError):
    """The stored rendezvous state is unreadable or contradicts itself."""


class CheckpointError(ShoalError):
    """A checkpoint could not be written or none could be read."""


# ----------------------------------------------------------------------------- backend

class RendezvousBackend(abc.ABC):
    """Stores the rendezvous state of one run; all the logic lives above it."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The backend's kind, e.g. 'etcd' or 'store'."""

    @abc.abstractmethod
    def get_state(self) -> Optional[tuple[bytes, Token]]:
        """Return the state and its token, or None if no state was ever written.

        Raises:
            RendezvousError: the backend could not be reached within its timeout.
        """

    @abc.abstractmethod
    def set_state(
        self, state: bytes, token: Optional[Token] = None
    ) -> Optional[tuple[bytes, Token, bool]]:
        """Write `state` only if the stored state still has `token` (None: no state yet).

        Args:
            state: the new state, opaque bytes.
            token: the token `get_state` returned, or None to create the first state.

        Returns:
            (current state, its token, whether ours was written); None if, after a failed
            write, no state exists at all.

        Raises:
            RendezvousError: the backend could not be reached within its timeout.
        """

    def watch(self, token: Optional[Token], timeout: TimeoutLike) -> None:
        """Block until the state changes from `token`, or `timeout` passes (no error then).

        The default polls briefly; backends that can be told of a change override it.
        """
        seconds = to_seconds(timeout, 0.0)
        end = time.monotonic() + seconds
        while True:
            current = self.get_state()
            if (None if current is None else current[1]) != token:
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def describe(self) -> str:
        """Where the state lives, for messages (e.g. 'etcd at 10.0.0.5:2379')."""
        store = getattr(self, "store", None)
        address = getattr(store, "address", None)
        return f"the {self.name} backend" + (f" at {address}" if address else "")

    def close(self) -> None:
        """Release connections and threads; the backend is unusable afterwards."""


# ----------------------------------------------------------------------------- settings

def check_seconds(name: str, value: float, *, allow_zero: bool = False) -> float:
    """`value` as float seconds if it is a finite number above zero (or zero, if allowed).

    The one rule for every rendezvous timeout, whether it comes from code or `--rdzv-conf`.

    Raises:
        ValueError: naming `name`, the value and the rule.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Rendezvous setting {name} must be a number of seconds, got {value!r}.")
    value = float(value)
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        rule = "zero or more" if allow_zero else "more than zero"
        raise ValueError(f"Rendezvous setting {name} must be {rule} seconds, got {value!r}.")
    if math.isinf(value):
        # A hang is a bug: every wait ends, if only after a long time.
        raise ValueError(f"Rendezvous setting {name} must be a finite number of seconds, got "
                         f"{value!r}.")
    return value


def check_seconds_in(name: str, value: float, bounds: tuple[float, float]) -> float:
    """`value` as float seconds if it is a number within `bounds` (both ends included).

    Raises:
        ValueError: naming `name`, the value and the range.
    """
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            low <= value <= high):  # NaN fails the comparison too
        raise ValueError(f"Rendezvous setting {name} must be {low:g} to {high:g} seconds, got "
                         f"{value!r}.")
    return float(value)


def check_lease_ttl(ttl: float) -> float:
    """An etcd lease's time to live: 2 to 3600 seconds (etcd's own floor and a sane ceiling).

    Raises:
        ValueError: naming the value and the rule.
    """
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 2 <= ttl <= 3600:
        raise ValueError(f"etcd lease ttl must be 2..3600 seconds, got {ttl!r}.")
    return float(ttl)


# The `--rdzv-conf` keys that are RendezvousSettings fields -> what they mean (for --help).
SETTINGS_CONF_KEYS: Mapping[str, str] = {
    "join_timeout": "seconds a node waits for the first round to form",
    "last_call_timeout": "seconds to wait for more nodes once the minimum has joined",
    "heartbeat_interval": "seconds between an agent's heartbeats",
    "heartbeat_timeout": "seconds without a heartbeat before a node is dead",
    "join_outage_timeout": "seconds a joining node waits for an unreachable etcd or store "
                           f"before it gives up ({JOIN_OUTAGE_TIMEOUT_RANGE_S[0]:g} to "
                           f"{JOIN_OUTAGE_TIMEOUT_RANGE_S[1]:g}, default "
                           f"{DEFAULT_JOIN_OUTAGE_TIMEOUT_S:g}; training never ends for it)",
}


@dataclasses.dataclass(frozen=True)
class RendezvousSettings:
    """How one run meets: node counts and every timeout, in seconds.

    The one place their rules live: the launcher and the registry build this to check them.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT_S
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # Only while joining (no round yet, or waiting for the next): once workers run, an
    # unreachable backend never ends the job.
    join_outage_timeout: float = DEFAULT_JOIN_OUTAGE_TIMEOUT_S

    def __post_init__(self):
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"Rendezvous run_id must be a non-empty string, got {self.run_id!r}.")
        if any(c in self.run_id for c in "/\\\x00") or self.run_id in (".", ".."):
            raise ValueError(
                f"Rendezvous run_id {self.run_id!r} may not contain '/', '\\' or NUL "
                "(it names a key prefix)."
            )
        for name in ("min_nodes", "max_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Rendezvous setting {name} must be an integer >= 1, got {value!r}.")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"Rendezvous max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})."
            )
        for name in SETTINGS_CONF_KEYS:
            if name == "join_outage_timeout":
                value = check_seconds_in(name, getattr(self, name), JOIN_OUTAGE_TIMEOUT_RANGE_S)
            else:
                value = check_seconds(name, getattr(self, name),
                                      allow_zero=name == "last_call_timeout")
            object.__setattr__(self, name, value)
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"Rendezvous heartbeat_timeout ({self.heartbeat_timeout:g}s) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval:g}s), or every node looks dead."
            )

    @classmethod
    def from_conf(
        cls, run_id: str, min_nodes: int, max_nodes: int, conf: Mapping[str, object]
    ) -> "RendezvousSettings":
        """Build settings from `--rdzv-conf` pairs (timeouts as numbers or strings of seconds).

        Keys that are not settings are left for the backend and the launcher; a value that is
        not a number raises ValueError naming the key.
        """
        values: dict[str, float] = {}
        for key in SETTINGS_CONF_KEYS:
            raw = conf.get(key, conf.get(key.replace("_", "-")))
            if raw is None:
                continue
            try:
                values[key] = float(raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"--rdzv-conf {key}={raw!r} is not a number of seconds."
                ) from exc
        return cls(run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, **values)


# ----------------------------------------------------------------------------- result

@dataclasses.dataclass
class RendezvousInfo:
    """What `next_rendezvous` returns: this node's place in one completed round."""

    round: int
    group_rank: int
    num_nodes: int
    participants: list[str]
    store: Store
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    def publish_master(self, addr: str, port: int) -> None:
        """Rank 0's node announces where its workers' TCPStore listens (for this round)."""
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"Master port must be an integer in 1..65535, got {port!r}.")
        if not isinstance(addr, str) or not addr:
            raise ValueError(f"Master address must be a non-empty host name or IP, got {addr!r}.")
        if ":" in addr and not addr.startswith("["):
            addr = f"[{addr}]"  # IPv6 literals go in brackets so 'addr:port' splits unambiguously
        self.store.set(MASTER_KEY, f"{addr}:{port}")
        self.master_addr, self.master_port = addr.strip("[]"), port

    def read_master(self, timeout: TimeoutLike = DEFAULT_MASTER_TIMEOUT_S) -> tuple[str, int]:
        """Wait for rank 0's node to publish its master address; return (addr, port).

        Raises:
            RendezvousTimeoutError: nothing was published within `timeout`.
        """
        # Late: this module holds the settings the launcher parses its flags into, and that
        # parsing loads no collectives; a round's store has loaded them by the time it is read.
        from shoal.collectives.types import StoreTimeout  # noqa: PLC0415

        seconds = to_seconds(timeout, DEFAULT_MASTER_TIMEOUT_S)
        try:
            raw = self.store.get(MASTER_KEY, seconds).decode()
        except StoreTimeout as exc:
            raise RendezvousTimeoutError(
                f"Node rank {self.group_rank} waited {seconds:g}s in round {self.round} for "
                f"rank 0's node ({self.participants[0] if self.participants else '?'}) to "
                "publish its master address; it never did."
            ) from exc
        addr, _, port = raw.rpartition(":")
        try:
            self.master_addr, self.master_port = addr.strip("[]"), int(port)
        except ValueError as exc:
            raise RendezvousStateError(
                f"Round {self.round}'s master address {raw!r} is not 'host:port'."
            ) from exc
        return self.master_addr, self.master_port
