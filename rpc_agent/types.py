"""Public settings, names and errors of the RPC agent (torch.distributed.rpc's, shoal's way).

torch's `rpc.api` module, the functions, is `rpc_agent.api`; this module holds the types they
use, so that every part of the agent can import them without importing the functions.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import re
from typing import Optional, Union

from shoal.core.backend import Device
from shoal.core.errors import AuthenticationError, DeviceError, ShoalError
from shoal.core.timeouts import to_seconds

# Defaults, in one table (docs/design.md: "defaults live in one constants table per
# package").
DEFAULT_RPC_TIMEOUT_S = 60.0
DEFAULT_INIT_TIMEOUT_S = 120.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0
DEFAULT_NUM_WORKER_THREADS = 16
# Out-of-band buffers (and pickles) at least this large travel on the data channel; smaller
# ones ride inline in the frame, where one gRPC message carries many of them.
DEFAULT_DATA_THRESHOLD_BYTES = 64 * 1024
# Memory kept for reuse by large received buffers (transport/receive_buffers.py says why).
DEFAULT_RECEIVE_CACHE_BYTES = 256 * 1024 * 1024
# Bounds on what a peer may send, even an authenticated one.
MAX_GRPC_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_TRANSFER_BYTES = 1 << 40
# How far a stream proof's timestamp may be from this worker's clock.
AUTH_WINDOW_S = 120.0
# A worker's first contact with a peer (dial, auth, hello) must finish within this.
CONNECT_TIMEOUT_S = 10.0

TimeoutArg = Union[datetime.timedelta, float, int, None]


# ----------------------------------------------------------------------------- errors

class RpcError(ShoalError, RuntimeError):
    """An RPC failed: the agent is not running, a peer is unknown or gone, or a call is bad."""


class RpcTimeout(RpcError, TimeoutError):
    """A call (or a wait on its Future) ran past its timeout; names the callee and function."""


class RpcPeerLost(RpcError, ConnectionError):
    """The stream or data channel to a peer died with the call pending, or (in init_rpc) the
    worker hosting the rendezvous store went away; names the peer."""


class RpcAuthenticationError(RpcError, AuthenticationError):
    """init_rpc could not use this job's secret: the rendezvous store refused this worker's,
    or no usable one is set. An RpcError like every failure of init_rpc, and still the
    AuthenticationError it wraps (its `__cause__`), so `except AuthenticationError` holds."""


class RpcFunctionNotFound(RpcError):
    """The callee cannot find the called function: its module does not import there, or lacks
    the name (functions travel by reference, as in torch). An RpcError, hence a RuntimeError
    as torch's rpc_sync/rpc_async raise; the concrete class is also the AttributeError or
    ModuleNotFoundError that the lookup raised (torch's remote().to_here() raises the former)."""


class RpcFunctionNotDefined(RpcFunctionNotFound, AttributeError):
    """The function's module imports on the callee but has no such name."""


class RpcFunctionModuleNotFound(RpcFunctionNotFound, ModuleNotFoundError):
    """The function's module cannot be imported on the callee."""


class RemoteException(RpcError):
    """A remote exception whose type cannot be rebuilt here; keeps its type name and traceback.

    When the type can be rebuilt, the caller gets that type itself instead, with the remote
    traceback in `remote_traceback`, as its `__cause__` and in a note.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str, worker: str):
        super().__init__(
            f"{type_name}: {message}\n\nRaised on worker {worker!r}; remote traceback:\n"
            f"{remote_traceback}"
        )
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.worker = worker

    def __reduce__(self):
        return (
            type(self),
            (self.type_name, self.remote_message, self.remote_traceback, self.worker),
        )


# ----------------------------------------------------------------------------- names

_NAME_CHARS = re.compile(r"[A-Za-z0-9_:\-]*")
# torch's RpcAgent::MAX_NAME_LEN: a name must be strictly shorter than this.
MAX_NAME_LENGTH = 128


class WorkerNameError(RpcError, ValueError):
    """A worker name breaks torch's rule. A ValueError, as shoal reports bad input, and through
    RpcError the RuntimeError torch's WorkerInfo raises, so `except RuntimeError` catches it."""


def check_worker_name(name) -> None:
    """torch's rule for worker names: 1 to 127 (shorter than 128) of the ASCII characters
    A-Z a-z 0-9 _ - : (they travel in stores and logs, and the RRef machinery parses them).

    Raises:
        WorkerNameError: the name is not a str, is empty, too long or has another character.
    """
    if not isinstance(name, str) or not name or len(name) >= MAX_NAME_LENGTH \
            or not _NAME_CHARS.fullmatch(name):
        raise WorkerNameError(
            f"A worker name must be 1 to {MAX_NAME_LENGTH - 1} characters of A-Z, a-z, 0-9, "
            f"'_', '-' and ':' (torch's rule: shorter than {MAX_NAME_LENGTH}), got {name!r}."
        )


class BackendType(enum.Enum):
    """init_rpc's `backend`: shoal has one agent (gRPC streams plus a raw data channel) and
    accepts torch's TENSORPIPE for it, so torch scripts run unchanged."""

    TENSORPIPE = "TENSORPIPE"
    GRPC = "GRPC"


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A worker's name and id (its rank), as `get_worker_info` returns them."""

    name: str
    id: int

    def __post_init__(self):
        check_worker_name(self.name)
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 0:
            raise ValueError(f"A worker id must be a non-negative int, got {self.id!r}.")

    def __str__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


# ----------------------------------------------------------------------------- settings

@dataclasses.dataclass
class RpcBackendOptions:
    """How `init_rpc` bootstraps and how the agent behaves.

    Args:
        init_method: "env://" (MASTER_ADDR, MASTER_PORT), "tcp://host:port" (rank 0 hosts a
            TCPStore there) or "file:///path" (a FileStore); ignored when `store` is given.
        store: an existing collectives.Store every worker shares (not closed by shutdown).
        rpc_timeout: default per-call timeout (seconds or timedelta); 0 means none.
        num_worker_threads: threads that run incoming calls.
        host: the address this worker binds and advertises for its two ports; None (the
            default) picks the local address that routes to the rendezvous store's host, which
            is loopback when the store is on this machine.
        data_threshold: buffers of at least this many bytes go over the data channel.
        receive_cache_bytes: memory the worker may keep for reuse by received buffers of 1 MiB
            and more (held once used, until shutdown); 0 gives every transfer fresh memory.
        init_timeout: bound on init_rpc's rendezvous (store, names, first connections).
        store_prefix: namespace of this job's keys in the store (change it to reuse a store).
        token: the job's secret (default: core.auth.load_token()).
    """

    init_method: str = "env://"
    store: Optional[object] = dataclasses.field(default=None, compare=False, repr=False)
    rpc_timeout: TimeoutArg = DEFAULT_RPC_TIMEOUT_S
    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS
    host: Optional[str] = None
    data_threshold: int = DEFAULT_DATA_THRESHOLD_BYTES
    receive_cache_bytes: int = DEFAULT_RECEIVE_CACHE_BYTES
    init_timeout: TimeoutArg = DEFAULT_INIT_TIMEOUT_S
    store_prefix: str = "shoal_rpc"
    token: Optional[Union[str, bytes]] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        # Normalise timeouts to float seconds so the agent never re-parses them.
        for field in ("rpc_timeout", "init_timeout"):
            try:
                seconds = to_seconds(getattr(self, field))
            except ValueError as exc:
                raise ValueError(f"RpcBackendOptions.{field}: {exc}") from exc
            if seconds is None:
                raise ValueError(f"RpcBackendOptions.{field} must be given, got None.")
            object.__setattr__(self, field, seconds)
        if not isinstance(self.init_method, str) or not self.init_method.startswith(
            ("env://", "tcp://", "file://")
        ):
            raise ValueError(
                "RpcBackendOptions.init_method must start with env://, tcp:// or file://, "
                f"got {self.init_method!r}."
            )
        if self.store is not None:
            from shoal.collectives.store.api import (  # noqa: PLC0415  (keeps `api` import-light)
                Store,
            )

            if not isinstance(self.store, Store):
                raise TypeError(
                    f"RpcBackendOptions.store must be a collectives.Store, got "
                    f"{type(self.store).__name__}."
                )
        self._require_int("num_worker_threads", 1, "a positive int")
        self._require_int("data_threshold", 1, "a positive int of bytes")
        self._require_int("receive_cache_bytes", 0, "a non-negative int of bytes")
        if not self.store_prefix or "/" in self.store_prefix:
            raise ValueError(
                f"RpcBackendOptions.store_prefix must be a non-empty name without '/', got "
                f"{self.store_prefix!r}."
            )

    def _require_int(self, field: str, minimum: int, what: str) -> None:
        value = getattr(self, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"RpcBackendOptions.{field} must be {what}, got {value!r}.")


DeviceLike = Union[int, str, Device]


def _to_device(spec: DeviceLike) -> Device:
    """torch's device spelling in a device map: an int is that cuda device, a str or Device
    is parsed as one ('cpu', 'cuda:1')."""
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return Device("cuda", spec)
    if isinstance(spec, (str, Device)):
        return Device(spec)
    raise DeviceError(f"A device map entry must be a device index, name or Device, got {spec!r}.")


def _to_device_map(to: str, device_map: dict) -> dict[Device, Device]:
    """One worker's map as Device -> Device, refusing one that is not one-to-one (torch's
    rule: replies travel back through its inverse)."""
    if not isinstance(device_map, dict):
        raise TypeError(
            f"The device map for worker {to!r} must be a dict of this worker's devices to its "
            f"devices, got {type(device_map).__name__}."
        )
    full: dict[Device, Device] = {}
    sources: dict[Device, Device] = {}
    for key, value in device_map.items():
        src, dst = _to_device(key), _to_device(value)
        if dst in sources and sources[dst] != src:
            raise ValueError(
                f"The device map for worker {to!r} maps both {sources[dst]} and {src} to {dst}; "
                "a device map must be one-to-one."
            )
        full[src], sources[dst] = dst, src
    return full


@dataclasses.dataclass(init=False)
class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's options class under its own name and keyword signature, for scripts that build
    it (`TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20,
    device_maps={"worker1": {0: 1}})`); it is shoal's RpcBackendOptions. `device_maps` and
    `devices` are kept as torch keeps them (devices parsed, maps copied and one-to-one, and
    carried into the copy init_rpc takes) for `set_device_map` and introspection: shoal moves
    cupy arrays between workers by their own device, so a map changes nothing yet.
    `_transports`/`_channels` (TensorPipe internals) are accepted and ignored."""

    device_maps: dict = dataclasses.field(default_factory=dict)
    devices: list = dataclasses.field(default_factory=list)

    def __init__(self, *, num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: TimeoutArg = DEFAULT_RPC_TIMEOUT_S, init_method: str = "env://",
                 device_maps: Optional[dict] = None, devices: Optional[list] = None,
                 _transports=None, _channels=None, **shoal_options):
        super().__init__(init_method=init_method, rpc_timeout=rpc_timeout,
                         num_worker_threads=num_worker_threads, **shoal_options)
        if device_maps is not None and not isinstance(device_maps, dict):
            raise TypeError(
                f"TensorPipeRpcBackendOptions.device_maps must be a dict of worker name to "
                f"device map, got {type(device_maps).__name__}."
            )
        self.device_maps = {}
        for to, device_map in (device_maps or {}).items():
            check_worker_name(to)
            self.device_maps[to] = _to_device_map(to, device_map)
        self.devices = [_to_device(d) for d in devices or []]

    def set_device_map(self, to: str, device_map: dict) -> None:
        """Also map this worker's devices to `to`'s as `device_map` (torch's API); a device
        already mapped elsewhere for `to`, or a map that stops being one-to-one, is refused."""
        check_worker_name(to)
        current = dict(self.device_maps.get(to, {}))
        for src, dst in _to_device_map(to, device_map).items():
            if src in current and current[src] != dst:
                raise ValueError(
                    f"The device map for worker {to!r} already maps {src} to {current[src]}; "
                    f"it cannot map it to {dst} too."
                )
            current[src] = dst
        self.device_maps[to] = _to_device_map(to, current)

    def set_devices(self, devices: list) -> None:
        """The devices this worker uses (torch's API)."""
        self.devices = [_to_device(d) for d in devices]
