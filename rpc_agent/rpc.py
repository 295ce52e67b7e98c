"""The public functions: init_rpc, shutdown, rpc_sync, rpc_async, remote, get_worker_info.

Bootstrap: every worker publishes its name and two ports under `<store_prefix>/worker/<rank>`
(JSON, never pickle: the store is not where peers prove themselves), reads everyone's, opens
the stream and data channel of each pair where it has the lower id, and waits until every
worker has done so. Shutdown is the same store used as a barrier.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import urllib.parse
from typing import Any, Callable, Optional

from shoal.collectives import env as collectives_env
from shoal.collectives.store.api import Store
from shoal.collectives.types import StoreError, StoreTimeout, StoreUnreachable
from shoal.collectives.store.prefix import PrefixStore
from shoal.core import auth
from shoal.core.errors import AuthenticationError, ShoalError
from shoal.core.timeouts import Deadline, to_seconds
from shoal.core.profiler import state as _profiler
from shoal.core.settings import RESTART_COUNT
from shoal.rpc_agent import _current
from shoal.rpc_agent import profiling
from shoal.rpc_agent.agent import RpcAgent, WorkerRef
from shoal.rpc_agent.dist_autograd import release as dist_autograd_release
from shoal.rpc_agent.types import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    BackendType,
    RpcAuthenticationError,
    RpcBackendOptions,
    RpcError,
    RpcPeerLost,
    RpcTimeout,
    TimeoutArg,
    WorkerInfo,
    check_worker_name,
)
from shoal.rpc_agent.futures import Future
from shoal.rpc_agent.rref import RRef

logger = logging.getLogger(__name__)

# After the shutdown barrier, the worker hosting the store waits this long for the others to
# leave it, so that nobody's last store call hits a closed server.
_EXIT_WAIT_S = 10.0

# What a worker whose secret was refused must be told.
_SET_THE_SECRET = (
    "Give every worker the same secret: set SHOAL_AUTH_TOKEN (or SHOAL_AUTH_TOKEN_FILE, naming a "
    "file that holds it) in every worker's environment, or pass it as "
    "RpcBackendOptions(token=...); shoal run sets one for the whole job."
)

_lock = threading.Lock()
_store_state: dict[str, Any] = {}
# Tests set this to widen the window between reading the worker table and recording it
# (issue 24's start-up race); called with the agent, never set in production.
_before_set_workers: Optional[Callable[[RpcAgent], None]] = None


# ----------------------------------------------------------------------------- init

def init_rpc(name: str, backend=None, rank: Optional[int] = None,
             world_size: Optional[int] = None,
             rpc_backend_options: Optional[RpcBackendOptions] = None) -> None:
    """Start this process's RPC agent as worker `name` of `world_size` and meet the others.

    torch's signature: `backend` is None or a BackendType (TENSORPIPE and GRPC both mean
    shoal's agent); `rank` (None or -1) and `world_size` default to the RANK and WORLD_SIZE
    environment variables. shoal's older positional form `init_rpc(name, rank, world_size)`
    still works: an int in `backend`'s place is taken as the rank.

    Raises:
        RpcError: already initialized, a duplicate name, or the others did not show up within
            `init_timeout` (RpcTimeout; the message names the missing ranks, or the worker
            hosting the rendezvous store when that one stopped answering), or the worker
            that hosts the rendezvous store (rank 0 with tcp://) went away during init
            (RpcPeerLost, naming it), or the store refused this worker's secret or none
            usable is set (RpcAuthenticationError, saying how to set one): every failure of
            init is an RpcError.
        ValueError: a bad name, backend, rank or world size.
    """
    options, rank, world_size = _init_arguments(name, backend, rank, world_size,
                                                rpc_backend_options)
    me = f"RPC: worker {name!r} (rank {rank}) could not finish init_rpc"
    with _lock:
        if _current.peek() is not None:
            raise RpcError(
                f"RPC is already initialized in this process as worker "
                f"{_current.peek().info.name!r}; call shutdown() first."
            )
        deadline = Deadline(options.init_timeout)
        try:
            # One secret for the store and the agent, resolved once: a bad one (an unreadable
            # file, a placeholder, none set off loopback) fails here, before any socket.
            options = dataclasses.replace(options, token=auth.load_token(options.token))
        except AuthenticationError as exc:
            raise RpcAuthenticationError(f"{me}: {exc}") from exc
        raw_store, owns_store = _make_store(options, rank, world_size, me)
        if options.host is None:
            # Peers on other hosts must reach this worker: never advertise loopback to them.
            options = dataclasses.replace(options, host=collectives_env.bind_host_for(raw_store))
        store = PrefixStore(_prefix(options), raw_store)
        agent: Optional[RpcAgent] = None
        try:
            try:
                agent = RpcAgent(name, rank, world_size, options)
            except AuthenticationError as exc:  # the development token on a public address
                raise RpcAuthenticationError(f"{me}: {exc}") from exc
            agent.start_servers()
            _current.set_agent(agent)
            try:
                _rendezvous(agent, store, deadline)
            except RpcError:  # a wait's timeout, a duplicate name, a peer's stream: named
                raise
            except (ShoalError, ConnectionError) as exc:  # the store failed under a call
                raise _store_failed(me, options, rank, exc) from exc
        except BaseException:
            _current.set_agent(None)
            if agent is not None:
                agent.close()
            if owns_store:
                raw_store.close()
            raise
        _store_state.update(store=store, raw_store=raw_store, owns_store=owns_store)
    logger.info("RPC worker %r (rank %d of %d) is up on ports %d (stream) and %d (data).",
                name, rank, world_size, agent.grpc_port, agent.data_port)


def _init_arguments(name: str, backend, rank: Optional[int], world_size: Optional[int],
                    rpc_backend_options: Optional[RpcBackendOptions],
                    ) -> tuple[RpcBackendOptions, int, int]:
    """init_rpc's arguments checked: (a copy of the options, the rank, the world size), with
    shoal's older positional form and the environment's RANK and WORLD_SIZE resolved."""
    if isinstance(backend, int) and not isinstance(backend, bool):
        # shoal's older init_rpc(name, rank, world_size, rpc_backend_options): shift them.
        if world_size is not None and not isinstance(world_size, int) \
                and rpc_backend_options is None:
            rpc_backend_options, world_size = world_size, None
        backend, rank, world_size = None, backend, (rank if rank is not None else world_size)
    if backend is not None and not isinstance(backend, BackendType):
        raise ValueError(
            f"init_rpc's backend must be None or a BackendType (TENSORPIPE or GRPC), got "
            f"{backend!r}."
        )
    options = rpc_backend_options or RpcBackendOptions()
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(
            f"rpc_backend_options must be an RpcBackendOptions, got {type(options).__name__}."
        )
    # Options are mutable (as torch's): check what they hold now, on a copy the agent keeps.
    options = dataclasses.replace(options)
    check_worker_name(name)
    if rank == -1:
        rank = None  # torch's "from the environment"
    rank = collectives_env.env_rank() if rank is None else rank
    world_size = collectives_env.env_world_size() if world_size is None else world_size
    if world_size is None or isinstance(world_size, bool) or not isinstance(world_size, int) \
            or world_size < 1:
        raise ValueError(
            f"init_rpc needs a positive world_size (or WORLD_SIZE), got {world_size!r}."
        )
    if rank is None or isinstance(rank, bool) or not isinstance(rank, int) \
            or not 0 <= rank < world_size:
        raise ValueError(f"init_rpc needs a rank in 0..{world_size - 1} (or RANK), got {rank!r}.")
    return options, rank, world_size


def _prefix(options: RpcBackendOptions) -> str:
    # A restarted elastic group reuses the launcher's store: keep attempts apart.
    if not RESTART_COUNT.is_set():
        return options.store_prefix
    return f"{options.store_prefix}-r{RESTART_COUNT.get()}"


def _make_store(options: RpcBackendOptions, rank: int, world_size: int,
                me: str) -> tuple[Store, bool]:
    """The rendezvous store and whether init_rpc made it (and closes it); `me` starts the
    messages of its errors. `options.token` is the resolved secret."""
    if options.store is not None:
        return options.store, False
    from shoal.collectives.store.tcp import TCPStore  # noqa: PLC0415

    url = urllib.parse.urlparse(options.init_method)
    if url.scheme == "file":
        from shoal.collectives.store.file import FileStore  # noqa: PLC0415

        return FileStore(url.path, world_size=world_size, timeout=options.init_timeout), True
    if url.scheme == "env":
        host, port = collectives_env.env_master()
        if host is None or port is None:
            raise RpcError(
                "init_method 'env://' needs MASTER_ADDR and MASTER_PORT; got "
                f"MASTER_ADDR={host!r}, MASTER_PORT={port!r}."
            )
        is_master = rank == 0 and not collectives_env.use_agent_store()
    else:
        host, port = url.hostname, url.port
        if not host or port is None:
            raise RpcError(f"init_method {options.init_method!r} must look like tcp://host:port.")
        is_master = rank == 0
    where = f"the rendezvous store at {host}:{port}"
    try:
        # The store's own check, made first so that an AuthenticationError from TCPStore below
        # can only be the server turning this worker's secret away.
        auth.require_secret_for(options.token, host, where)
    except AuthenticationError as exc:
        raise RpcAuthenticationError(f"{me}: {exc}") from exc
    keeper = _store_keeper(options, rank)
    try:
        store = TCPStore(host, port, world_size=world_size, is_master=is_master,
                         timeout=options.init_timeout, wait_for_workers=False,
                         token=options.token)
    except AuthenticationError as exc:
        raise _secret_refused(me, where, keeper) from exc
    except StoreError as exc:
        hosted = "" if keeper is None else f", which worker rank {keeper} hosts,"
        # The constructor retried for init_timeout: never reaching the store is a timeout.
        kind = RpcTimeout if isinstance(exc, StoreUnreachable) else RpcError
        raise kind(
            f"Worker rank {rank} could not reach the rendezvous store at {host}:{port}{hosted} "
            f"within init_timeout {options.init_timeout:g}s: {exc}"
        ) from exc
    return store, True


def _store_keeper(options: RpcBackendOptions, rank: int) -> Optional[int]:
    """The rank of the other worker whose process serves the rendezvous store (rank 0 with
    tcp://, and with env:// outside `shoal run`), or None: losing that store means that
    worker is gone, so init names it."""
    if options.store is not None or rank == 0:
        return None
    scheme = urllib.parse.urlparse(options.init_method).scheme
    if scheme == "tcp" or (scheme == "env" and not collectives_env.use_agent_store()):
        return 0
    return None


def _store_failed(me: str, options: RpcBackendOptions, rank: int,
                  exc: Exception) -> RpcError:
    """init_rpc's error for a store call that failed other than by a wait's timeout (`me`
    starts the message, `exc` is a StoreError or the store's ShoalError/ConnectionError)."""
    where = ("the store given in RpcBackendOptions.store" if options.store is not None
             else f"the rendezvous store of {options.init_method}")
    keeper = _store_keeper(options, rank)
    if isinstance(exc, AuthenticationError):
        return _secret_refused(me, where, keeper)
    if isinstance(exc, StoreTimeout):  # the store answered: the keys it names never came
        return RpcTimeout(f"{me}: {where} timed out: {exc}")
    if _went_unanswered(exc):
        # A connection still open but silent: the keeper is slow or stopped, not gone.
        missing = where if keeper is None else f"worker rank {keeper}, which hosts {where},"
        named = "" if keeper is None else f", so rank {keeper} is missing"
        return RpcTimeout(
            f"{me}: {missing} did not answer in time (it is stopped or overloaded){named}. "
            f"The store call failed with: {exc}"
        )
    if keeper is not None:
        return RpcPeerLost(
            f"{me}: worker rank {keeper}, which hosts {where}, is gone (it died or gave up its "
            f"own init_rpc), so rank {keeper} is missing. The store call failed with: {exc}"
        )
    return RpcError(f"{me}: {where} failed: {exc}")


def _went_unanswered(exc: BaseException) -> bool:
    """True when a socket timeout lies under `exc`: TCPStore reports a request the server
    never answered (and a dial it never greeted) as a StoreError caused by one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, TimeoutError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__
    return False


def _secret_refused(me: str, where: str, keeper: Optional[int]) -> RpcAuthenticationError:
    hosted = "" if keeper is None else f", which worker rank {keeper} hosts,"
    return RpcAuthenticationError(
        f"{me}: {where}{hosted} refused this worker's secret. {_SET_THE_SECRET}"
    )


def _rendezvous(agent: RpcAgent, store: Store, deadline: Deadline) -> None:
    info = agent.info
    store.set(f"worker/{info.id}", json.dumps({
        "name": info.name, "id": info.id, "host": agent.options.host,
        "grpc_port": agent.grpc_port, "data_port": agent.data_port,
        "grpc_incarnation": agent.grpc_incarnation.hex(),
    }))
    keys = [f"worker/{i}" for i in range(agent.world_size)]
    _wait_keys(store, keys, deadline, f"worker {info.name!r} waited in init_rpc", "joined")
    infos = [json.loads(raw) for raw in store.multi_get(keys, deadline.remaining())]
    seen: dict[str, int] = {}
    for item in infos:
        if item["name"] in seen:
            raise RpcError(
                f"Two workers are named {item['name']!r} (ranks {seen[item['name']]} and "
                f"{item['id']}); worker names must be unique."
            )
        seen[item["name"]] = item["id"]
    if _before_set_workers is not None:
        _before_set_workers(agent)
    agent.set_workers(infos)
    # A peer rejects a hello from a worker missing from its table: dial a higher-id peer only
    # once it has recorded the table (issue 24: the dial raced the peer's set_workers).
    store.set(f"table/{info.id}", "1")
    higher = [f"table/{i}" for i in range(info.id + 1, agent.world_size)]
    if higher:
        _wait_keys(store, higher, deadline, f"worker {info.name!r} waited in init_rpc",
                   "recorded the worker table")
    agent.connect_higher_peers(max(0.1, deadline.remaining()))
    store.set(f"connected/{info.id}", "1")
    _wait_keys(store, [f"connected/{i}" for i in range(agent.world_size)], deadline,
               f"worker {info.name!r} waited in init_rpc", "connected to their peers")


def _wait_keys(store: Store, keys: list[str], deadline: Deadline, what: str,
               verb: str) -> None:
    try:
        store.wait(keys, deadline.remaining())
    except StoreTimeout as exc:
        missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
        raise RpcTimeout(
            f"RPC: {what} {deadline.timeout:g}s, but rank(s) {', '.join(missing)} never "
            f"{verb}."
        ) from exc


# ----------------------------------------------------------------------------- shutdown

def shutdown(graceful: bool = True, timeout: TimeoutArg = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
    """Stop the agent. Graceful: first wait until no worker has outstanding work (this
    worker's calls done, its RRef forks released, every worker at this point).

    Raises:
        RpcTimeout: the wait took longer than `timeout`; names the calls or workers pending.
            The agent is stopped either way.
    """
    agent = _current.get()
    seconds = to_seconds(timeout, DEFAULT_SHUTDOWN_TIMEOUT_S)
    store = _store_state.get("store")
    try:
        if graceful:
            _graceful(agent, store, Deadline(seconds))
    finally:
        agent.begin_close()
        with _lock:
            _current.set_agent(None)
            state = dict(_store_state)
            _store_state.clear()
        agent.close()
        dist_autograd_release.drop_pending()
        if state.get("owns_store"):
            try:
                state["raw_store"].close()
            except Exception:
                logger.debug("Closing the RPC store failed", exc_info=True)


def _graceful(agent: RpcAgent, store: Store, deadline: Deadline) -> None:
    name = agent.info.name
    # Contexts that ended here end on their peers before anyone stops.
    dist_autograd_release.flush_all(deadline.remaining())
    _drain(agent, deadline, name)
    futures = agent.rrefs.release_all_users()
    _drain(agent, deadline, name)
    del futures
    store.set(f"shutdown/{agent.info.id}", "1")
    keys = [f"shutdown/{i}" for i in range(agent.world_size)]
    try:
        store.wait(keys, deadline.remaining())
    except StoreTimeout as exc:
        missing = [agent.worker_info(i) for i in range(agent.world_size)
                   if not store.check([keys[i]])]
        raise RpcTimeout(
            f"RPC shutdown of worker {name!r} timed out after {deadline.timeout:g}s waiting for "
            "every worker to finish its outstanding work: "
            + ", ".join(f"{w.name!r} (id {w.id})" for w in missing)
            + " never reached shutdown."
        ) from exc
    agent.begin_close()
    agent.close_outgoing()
    store.set(f"closed/{agent.info.id}", "1")
    try:
        store.wait([f"closed/{i}" for i in range(agent.world_size)],
                   min(_EXIT_WAIT_S, max(0.1, deadline.remaining())))
    except StoreTimeout:
        logger.info("Not every worker closed its streams in time; stopping anyway.")
    store.set(f"exit/{agent.info.id}", "1")
    raw = _store_state.get("raw_store")
    if getattr(raw, "server", None) is not None:
        # This process hosts the store: let the others finish their last calls on it first.
        try:
            store.wait([f"exit/{i}" for i in range(agent.world_size)], _EXIT_WAIT_S)
        except StoreTimeout:
            logger.info("Not every worker left the RPC store within %ss; closing it anyway.",
                        _EXIT_WAIT_S)


def _drain(agent: RpcAgent, deadline: Deadline, name: str) -> None:
    delay = 0.001
    while agent.pending_count() or agent.rrefs.outstanding():
        if deadline.expired():
            what = agent.pending_summary() if agent.pending_count() else agent.rrefs.outstanding()
            raise RpcTimeout(
                f"RPC shutdown of worker {name!r} timed out after {deadline.timeout:g}s with its "
                f"own work outstanding: {what}."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


# ----------------------------------------------------------------------------- calls

def get_worker_info(worker_name: Optional[WorkerRef] = None) -> WorkerInfo:
    """The WorkerInfo of a worker name or id (this worker's when None)."""
    return _current.get().worker_info(worker_name)


def get_rpc_timeout() -> float:
    """The default timeout of this worker's calls, in seconds (0: none), as torch's."""
    return _current.get().default_timeout


def _set_rpc_timeout(rpc_timeout: TimeoutArg) -> None:
    """Change the default timeout of this worker's later calls (torch's private helper,
    which its tests and some scripts use)."""
    _current.get().set_default_timeout(rpc_timeout)


def rpc_sync(to: WorkerRef, func: Callable, args: Optional[tuple] = None,
             kwargs: Optional[dict] = None, timeout: TimeoutArg = None) -> Any:
    """Run `func(*args, **kwargs)` on worker `to` and return its result.

    `timeout` defaults to the options' rpc_timeout; 0 means none.

    Raises:
        RpcTimeout: no reply in time (names the callee and the function).
        RpcPeerLost: the stream to `to` died with the call pending.
        The remote exception itself, with the remote traceback attached.
    """
    if _profiler.recorder is not None and (rec := profiling.wanted(func)) is not None:
        return profiling.profiled_sync(rec, to, func, args, kwargs, timeout)
    return _current.get().call_sync(to, func, args, kwargs, timeout)


def rpc_async(to: WorkerRef, func: Callable, args: Optional[tuple] = None,
              kwargs: Optional[dict] = None, timeout: TimeoutArg = None) -> Future:
    """Like `rpc_sync`, but return at once with a Future of the result."""
    if _profiler.recorder is not None and (rec := profiling.wanted(func)) is not None:
        return profiling.profiled_async(rec, to, func, args, kwargs, timeout)
    return _current.get().call(to, func, args, kwargs, timeout, "async")


def remote(to: WorkerRef, func: Callable, args: Optional[tuple] = None,
           kwargs: Optional[dict] = None, timeout: TimeoutArg = None) -> RRef:
    """Run `func` on worker `to`, which keeps the result; return an RRef to it at once."""
    if _profiler.recorder is not None and (rec := profiling.wanted(func)) is not None:
        return profiling.profiled_remote(rec, to, func, args, kwargs, timeout)
    return _current.get().remote(to, func, args, kwargs, timeout)
