"""`init_process_group` and the module-level collectives on the default group, as in
`torch.distributed`.

Ranks given to module-level functions (`src`, `dst`, `new_group(ranks)`) are world ranks, as in
torch; `ProcessGroup` methods take the group's own ranks. Backends are found by name in a
registry (`backends.registry`) and imported only when used: "tcp" (alias "gloo") and "nccl".
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from shoal.collectives import arrays, env, profiler_clock
from shoal.collectives.api import ProcessGroup, Work
from shoal.collectives.backends import registry
from shoal.collectives.store.api import Store
from shoal.collectives.types import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    CollectiveError,
    ReduceOp,
    make_premul_sum,
)
from shoal.collectives.constants import DEFAULT_GROUP_NAME
from shoal.core.timeouts import TimeoutLike, to_seconds

logger = logging.getLogger(__name__)

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank", "get_world_size",
    "get_backend", "new_group", "get_default_group", "get_process_group_ranks", "register_backend",
    "GroupMember", "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "broadcast_object_list", "gather", "scatter", "reduce_scatter",
    "all_to_all", "send", "recv", "isend", "irecv", "barrier", "monitored_barrier",
    "group", "get_group_rank", "get_global_rank", "get_node_local_rank", "is_available",
    "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
    "is_torchelastic_launched", "new_subgroups", "new_subgroups_by_enumeration",
    "rendezvous", "send_object_list", "recv_object_list", "reduce_scatter_tensor",
    "all_to_all_single", "gather_object", "scatter_object_list",
    "all_reduce_coalesced", "all_gather_coalesced", "P2POp", "batch_isend_irecv",
    "make_premul_sum", "_make_nccl_premul_sum", "reduce_scatter_single", "all_gather_single",
    "_all_gather_base", "_reduce_scatter_base",
]


def register_backend(name: str, target: Union[str, Callable[..., ProcessGroup]]) -> None:
    """Make `init_process_group(backend=name)` use `target` ("module:Class" or a callable)."""
    registry.register_backend(name, target)


class _NonMember:
    """What `new_group` returns on ranks outside the group (collectives on it do nothing)."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class _WorldAttribute(type):
    # torch's GroupMember.WORLD and group.WORLD read the default group at the time of asking
    # (None before init_process_group); a metaclass property gives the class that attribute.
    @property
    def WORLD(cls) -> Optional[ProcessGroup]:
        return _world.default


class GroupMember(metaclass=_WorldAttribute):
    """torch's names for the default group (`WORLD`) and for "not in this group"."""

    NON_GROUP_MEMBER = _NonMember()


class group(metaclass=_WorldAttribute):  # noqa: N801  (torch's name: dist.group.WORLD)
    """`group.WORLD`: the default group, as torch.distributed.group.WORLD."""


class _World:
    def __init__(self):
        self.lock = threading.RLock()
        self.default: Optional[ProcessGroup] = None
        self.store: Optional[Store] = None
        self.own_store = False
        self.backend = ""
        self.rank = -1
        self.size = -1
        self.timeout = DEFAULT_COLLECTIVE_TIMEOUT_S
        self.groups: dict[ProcessGroup, list[int]] = {}
        self.backend_names: dict[ProcessGroup, str] = {}  # as asked for: "gloo" stays "gloo"
        self.group_count = 0


_world = _World()


# ----------------------------------------------------------------------------- setup

def _int_or_none(value: Any) -> Optional[int]:
    # -1 is torch's "not given" (read it from the init method or the environment); any other
    # value, negative or not, is the caller's and is checked by _check_rank_and_size.
    if value is None or (isinstance(value, int) and value == -1):
        return None
    return int(value)


def _check_rank_and_size(rank: int, size: int, source: str) -> None:
    """Raise ValueError naming the value and the rule; `source` says where they came from."""
    if size < 1:
        raise ValueError(
            f"world_size must be at least 1 (the number of ranks in the group), got {size} "
            f"({source})."
        )
    if not 0 <= rank < size:
        raise ValueError(
            f"rank must be in [0, world_size) = [0, {size}), got {rank} ({source})."
        )


def _store_for(init_method: str, rank: Optional[int], size: Optional[int], timeout: float):
    """(store, rank, size) from an init method URL."""
    from shoal.collectives.store.file import FileStore
    from shoal.collectives.store.tcp import TCPStore

    url = urllib.parse.urlparse(init_method)
    query = dict(urllib.parse.parse_qsl(url.query))
    if rank is None and "rank" in query:
        rank = int(query["rank"])
    if size is None and "world_size" in query:
        size = int(query["world_size"])
    if url.scheme == "env":
        rank = rank if rank is not None else env.env_rank()
        size = size if size is not None else env.env_world_size()
        host, port = env.env_master()
        missing = [n for n, v in (("MASTER_ADDR", host), ("MASTER_PORT", port), ("RANK", rank),
                                  ("WORLD_SIZE", size)) if v is None]
        if missing:
            raise ValueError(
                f"init_method 'env://' needs the environment variables {', '.join(missing)} "
                "(or rank=/world_size= arguments); shoal run sets them for you."
            )
    elif url.scheme == "tcp":
        host, port = url.hostname, url.port
        if not host or port is None:
            raise ValueError(f"init_method {init_method!r} must look like tcp://HOST:PORT.")
        rank = rank if rank is not None else env.env_rank()
        size = size if size is not None else env.env_world_size()
        if rank is None or size is None:
            raise ValueError(f"init_method {init_method!r} needs rank= and world_size=.")
    elif url.scheme == "file":
        path = urllib.parse.unquote(url.path)
        if not path:
            raise ValueError(f"init_method {init_method!r} must look like file:///PATH.")
        rank = rank if rank is not None else env.env_rank()
        size = size if size is not None else env.env_world_size()
        if rank is None or size is None:
            raise ValueError(f"init_method {init_method!r} needs rank= and world_size=.")
        _check_rank_and_size(rank, size, f"init_method {init_method!r}")
        return FileStore(path, world_size=size, timeout=timeout), rank, size
    else:
        raise ValueError(
            f"init_method {init_method!r} is not supported; use env://, tcp://HOST:PORT or file:///PATH."
        )
    _check_rank_and_size(rank, size, f"init_method {init_method!r}")
    if port == 0 and size > 1:
        raise ValueError("MASTER_PORT 0 only works for a world of one; the other ranks need a real port.")
    is_master = rank == 0 and not (url.scheme == "env" and env.use_agent_store())
    # multi_tenant, as torch's env:// and tcp:// rendezvous: RPC on the same MASTER_ADDR:PORT
    # in this process shares the server instead of failing to bind it again.
    store = TCPStore(host, port, world_size=size, is_master=is_master, timeout=timeout,
                     multi_tenant=True)
    return store, rank, size


def rendezvous(url: str, rank: int = -1, world_size: int = -1, timeout: TimeoutLike = None,
               **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """torch.distributed.rendezvous: yields (store, rank, world_size) for an init method URL
    (env://, tcp://HOST:PORT?rank=&world_size=, file:///PATH), once.

    Raises:
        ValueError: the URL or the rank and world size are missing or inconsistent.
    """
    if not isinstance(url, str):
        raise ValueError(f"rendezvous needs an init method URL (str), got {type(url).__name__}.")
    seconds = to_seconds(timeout, env.collective_timeout() or DEFAULT_COLLECTIVE_TIMEOUT_S)
    yield _store_for(url, _int_or_none(rank), _int_or_none(world_size), seconds)


def init_process_group(
    backend: Optional[str] = "tcp",
    init_method: Optional[str] = None,
    timeout: TimeoutLike = None,
    world_size: int = -1,
    rank: int = -1,
    store: Optional[Store] = None,
    group_name: str = DEFAULT_GROUP_NAME,
    host: Optional[str] = None,
    pg_options: Any = None,
    device_id: Any = None,
) -> ProcessGroup:
    """Join the default process group (every rank calls it) and return it.

    torch's `pg_options` and `device_id` are accepted for its scripts and not used: the tcp
    backend has no options, and the nccl backend drives LOCAL_RANK's device.

    `init_method` is "env://" (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; rank 0 hosts the
    TCPStore unless SHOAL_USE_AGENT_STORE=1 says the launcher's agent hosts it),
    "tcp://HOST:PORT" (rank 0 hosts) or "file:///PATH"; or pass `store` with `rank` and
    `world_size`. `timeout` bounds forming the group and is every collective's default; when
    None, SHOAL_COLLECTIVE_TIMEOUT (set by `shoal run --collective-timeout`) or 600 s.

    Raises:
        ValueError: missing or inconsistent rank, world size or init method.
        BackendUnavailable: the backend cannot run here.
        CollectiveTimeout: the other ranks did not join within the timeout.
    """
    seconds = to_seconds(timeout, env.collective_timeout() or DEFAULT_COLLECTIVE_TIMEOUT_S)
    with _world.lock:
        if _world.default is not None:
            raise CollectiveError(
                "init_process_group was called twice; call destroy_process_group() first."
            )
        cls = registry.backend_class(backend)
        rank_, size_ = _int_or_none(rank), _int_or_none(world_size)
        own_store = store is None
        if store is None:
            store, rank_, size_ = _store_for(init_method or "env://", rank_, size_, seconds)
        elif init_method is not None:
            raise ValueError("Pass either init_method or store to init_process_group, not both.")
        elif rank_ is None or size_ is None:
            raise ValueError(
                "init_process_group with store= needs rank= and world_size= (rank in "
                f"[0, world_size), world_size >= 1); got rank={rank!r} and "
                f"world_size={world_size!r} (-1 means not given)."
            )
        else:
            _check_rank_and_size(rank_, size_, "given with store=")
        kwargs = dict(timeout=seconds, name=group_name, global_ranks=list(range(size_)))
        if host is not None:
            kwargs["host"] = host
        try:
            pg = cls(store, rank_, size_, **kwargs)
        except BaseException:
            if own_store:
                store.close()
            raise
        _world.default = pg
        _world.store = store
        _world.own_store = own_store
        _world.backend = registry.canonical_name(backend)
        _world.rank = rank_
        _world.size = size_
        _world.timeout = seconds
        _world.groups = {pg: list(range(size_))}
        _world.backend_names = {pg: registry.Backend(backend or registry.DEFAULT_BACKEND)}
        _world.group_count = 0
        profiler_clock.lend_store(pg)
        logger.debug("Rank %d joined the default group of %d ranks (%s)", rank_, size_, _world.backend)
        return pg


def is_initialized() -> bool:
    """True between init_process_group and destroy_process_group."""
    return _world.default is not None


def _default() -> ProcessGroup:
    pg = _world.default
    if pg is None:
        raise CollectiveError(
            "The default process group is not initialized; call collectives.init_process_group() first."
        )
    return pg


def get_default_group() -> ProcessGroup:
    """The default (world) group."""
    return _default()


def _group(group) -> Optional[ProcessGroup]:
    if group is None:
        return _default()
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}.")
    return group


def _local(group: ProcessGroup, world_rank: int, what: str) -> int:
    ranks = _world.groups.get(group)
    if ranks is None:
        ranks = getattr(group, "global_ranks", None) or list(range(group.size()))
    try:
        return ranks.index(world_rank)
    except ValueError:
        raise ValueError(
            f"{what} {world_rank} is not a member of group '{group.name}' (its ranks: {ranks})."
        ) from None


def _peer(pg: ProcessGroup, world_rank: Optional[int], group_rank: Optional[int],
          what: str) -> int:
    """The group rank a call names, by world rank (`src`, `dst`) or by torch's `group_src` /
    `group_dst` (a rank of the group); neither: 0."""
    if group_rank is not None:
        if world_rank is not None:
            raise ValueError(f"Pass {what} (a world rank) or group_{what} (a rank of the group), "
                             "not both.")
        return group_rank  # the ProcessGroup method checks its range
    return _local(pg, 0 if world_rank is None else world_rank, what)


def get_rank(group=None) -> int:
    """This process's rank in `group` (default: the world); -1 if it is not a member."""
    pg = _group(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group=None) -> int:
    """Number of ranks in `group` (default: the world); -1 if this rank is not a member."""
    pg = _group(group)
    return -1 if pg is None else pg.size()


def get_backend(group=None) -> str:
    """The name `group`'s backend was asked for by ("gloo", "tcp", "nccl"), as torch answers.

    Raises:
        ValueError: this rank is not a member of `group`.
    """
    pg = _group(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this rank is not a member of it.")
    name = _world.backend_names.get(pg)
    if name is None:  # a group made outside init_process_group/new_group
        name = registry.Backend(getattr(pg, "backend_name", _world.backend))
    return name


def get_process_group_ranks(group) -> list[int]:
    """World ranks of `group`'s members."""
    pg = _group(group)
    return list(_world.groups.get(pg, range(pg.size())))


def _member_group_ranks(group) -> tuple:
    """`group` (None: the default) and its world ranks; a group this rank is not in is refused."""
    pg = _group(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this rank is not a member of it.")
    return pg, get_process_group_ranks(pg)


def get_group_rank(group, global_rank: int) -> int:
    """`global_rank`'s rank within `group`, as torch.distributed.get_group_rank.

    Raises:
        ValueError: `global_rank` is not a member of `group`.
    """
    pg, ranks = _member_group_ranks(group)
    if global_rank not in ranks:
        raise ValueError(
            f"Global rank {global_rank} is not part of group {pg.name!r} (its ranks: {ranks})."
        )
    return ranks.index(global_rank)


def get_global_rank(group, group_rank: int) -> int:
    """The world rank of `group`'s rank `group_rank`, as torch.distributed.get_global_rank.

    Raises:
        ValueError: `group_rank` is not a rank of `group`.
    """
    pg, ranks = _member_group_ranks(group)
    valid = isinstance(group_rank, int) and not isinstance(group_rank, bool)
    if not valid or not 0 <= group_rank < len(ranks):
        raise ValueError(
            f"Group rank {group_rank!r} is not part of group {pg.name!r} (ranks 0..{len(ranks) - 1})."
        )
    return ranks[group_rank]


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """This process's rank on its node: LOCAL_RANK (set by shoal run), else `fallback_rank`.

    Raises:
        RuntimeError: LOCAL_RANK is unset and no fallback was given.
    """
    local = env.env_local_rank()
    if local is not None:
        return local
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment; start the ranks with shoal run, or pass "
        "fallback_rank= to get_node_local_rank."
    )


def is_available() -> bool:
    """True: shoal always has its collectives (torch.distributed.is_available)."""
    return True


def is_gloo_available() -> bool:
    """True: the tcp backend answers to "gloo"."""
    return True


def is_nccl_available() -> bool:
    """True where the nccl backend can run here (cupy, a CUDA device and the NCCL library)."""
    try:
        return registry.check_backend_availability("nccl") is None
    except CollectiveError:
        return False


def is_mpi_available() -> bool:
    """False: shoal has no MPI backend."""
    return False


def is_ucc_available() -> bool:
    """False: shoal has no UCC backend."""
    return False


def is_torchelastic_launched() -> bool:
    """True in a process started by `shoal run` (or torchrun): TORCHELASTIC_RUN_ID is set."""
    return env.torchelastic_run_id() is not None


def new_subgroups(group_size: Optional[int] = None, group=None, timeout: TimeoutLike = None,
                  backend: Optional[str] = None, pg_options: Any = None,
                  group_desc: Optional[str] = None):
    """Split the world into consecutive groups of `group_size` ranks; every rank calls it.

    Returns (this rank's subgroup, every subgroup), as torch.distributed.new_subgroups; an entry
    of the list is `GroupMember.NON_GROUP_MEMBER` on ranks outside that subgroup.

    Raises:
        ValueError: no group_size (torch's default, the local CUDA device count, is not used on
            CPU), or one that does not divide the world size.
    """
    if group is not None:
        raise ValueError("new_subgroups splits the default group only; pass group=None.")
    world = get_world_size()
    if group_size is None:
        raise ValueError(
            "new_subgroups needs group_size= (torch's default is the number of local CUDA "
            "devices, which a CPU job does not have)."
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
    if group_size > world or world % group_size:
        raise ValueError(
            f"The world size ({world}) must be divisible by group_size ({group_size})."
        )
    ranks = [list(range(start, start + group_size)) for start in range(0, world, group_size)]
    return new_subgroups_by_enumeration(ranks, timeout=timeout, backend=backend)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: TimeoutLike = None, backend: Optional[str] = None,
                                 pg_options: Any = None, group_desc: Optional[str] = None):
    """One group per list of world ranks (each rank in at most one); returns (the group this
    rank is in, or None; every group, NON_GROUP_MEMBER where this rank is not in it)."""
    if not ranks_per_subgroup_list:
        raise ValueError(
            "new_subgroups_by_enumeration needs at least one list of ranks, got "
            f"{ranks_per_subgroup_list!r}."
        )
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        overlap = seen.intersection(ranks)
        if overlap:
            raise ValueError(f"Rank(s) {sorted(overlap)} appear in more than one subgroup.")
        seen.update(ranks)
    mine = None
    subgroups = []
    for ranks in ranks_per_subgroup_list:
        pg = new_group(ranks, timeout=timeout, backend=backend)
        subgroups.append(pg)
        if pg is not GroupMember.NON_GROUP_MEMBER:
            mine = pg
    return mine, subgroups


def new_group(ranks: Optional[Sequence[int]] = None, timeout: TimeoutLike = None,
              backend: Optional[str] = None, group_name: Optional[str] = None,
              pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: Optional[str] = None, device_id: Any = None, sort_ranks: bool = True):
    """A group of some world ranks; every world rank must call it, in the same order.

    Returns the group on members and `GroupMember.NON_GROUP_MEMBER` on the others. torch's
    `pg_options`, `group_desc` and `device_id` are accepted and not used.

    Raises:
        ValueError: bad ranks; `use_local_synchronization=True` (every rank calls new_group
            here); `sort_ranks=False` with ranks out of order (group ranks follow world ranks).
    """
    if use_local_synchronization:
        raise ValueError(
            "new_group(use_local_synchronization=True) is not supported: every world rank "
            "calls new_group, in the same order."
        )
    if not sort_ranks and ranks is not None and list(ranks) != sorted(ranks):
        raise ValueError(
            f"new_group(sort_ranks=False) with ranks {list(ranks)} is not supported: a group's "
            "ranks follow their world ranks."
        )
    with _world.lock:
        _default()
        _world.group_count += 1
        ranks = list(range(_world.size)) if ranks is None else sorted(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < _world.size for r in ranks):
            raise ValueError(
                f"new_group ranks must be distinct world ranks in 0..{_world.size - 1}, got {ranks}."
            )
        name = group_name or f"group{_world.group_count}"
        if _world.rank not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        cls = registry.backend_class(backend or _world.backend)
        seconds = to_seconds(timeout, _world.timeout)
        pg = cls(_world.store, ranks.index(_world.rank), len(ranks), timeout=seconds, name=name,
                 global_ranks=ranks)
        _world.groups[pg] = ranks
        _world.backend_names[pg] = (registry.Backend(backend) if backend
                                    else _world.backend_names[_world.default])
        return pg


def destroy_process_group(group=None) -> None:
    """Leave `group`, or with None every group and the default one (closing its store)."""
    with _world.lock:
        if group is GroupMember.NON_GROUP_MEMBER:
            return
        if group is not None and group is not _world.default:
            group.shutdown()
            _world.groups.pop(group, None)
            _world.backend_names.pop(group, None)
            return
        if _world.default is None:
            return
        profiler_clock.take_back_store(_world.default)
        for pg in list(_world.groups):
            try:
                pg.shutdown()
            except Exception:  # keep tearing down the rest
                logger.exception("Shutting down group %r failed", pg.name)
        if _world.own_store and _world.store is not None:
            _world.store.close()
        _world.__init__()


# ----------------------------------------------------------------------------- collectives

def _ret(work: Work, async_op: bool) -> Optional[Work]:
    return work if async_op else None


def all_reduce(tensor, op: ReduceOp = ReduceOp.SUM, group=None, async_op: bool = False,
               timeout: TimeoutLike = None) -> Optional[Work]:
    """Reduce `tensor` across the group in place on every rank."""
    pg = _group(group)
    if pg is None:
        return None
    return _ret(pg.all_reduce(tensor, op, async_op=async_op, timeout=timeout), async_op)


def broadcast(tensor, src: Optional[int] = None, group=None, async_op: bool = False,
              timeout: TimeoutLike = None, group_src: Optional[int] = None) -> Optional[Work]:
    """Copy world rank `src`'s (or group rank `group_src`'s) `tensor` to every rank of the group."""
    pg = _group(group)
    if pg is None:
        return None
    root = _peer(pg, src, group_src, "src")
    return _ret(pg.broadcast(tensor, root, async_op=async_op, timeout=timeout), async_op)


def reduce(tensor, dst: Optional[int] = None, op: ReduceOp = ReduceOp.SUM, group=None,
           async_op: bool = False, timeout: TimeoutLike = None,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Reduce `tensor` into world rank `dst` (or group rank `group_dst`)."""
    pg = _group(group)
    if pg is None:
        return None
    root = _peer(pg, dst, group_dst, "dst")
    return _ret(pg.reduce(tensor, root, op, async_op=async_op, timeout=timeout), async_op)


def all_gather(tensor_list: list, tensor, group=None, async_op: bool = False,
               timeout: TimeoutLike = None) -> Optional[Work]:
    """Fill `tensor_list[j]` with group rank j's `tensor`."""
    pg = _group(group)
    if pg is None:
        return None
    return _ret(pg.all_gather(tensor_list, tensor, async_op=async_op, timeout=timeout), async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False,
                           timeout: TimeoutLike = None) -> Optional[Work]:
    """Every rank's `input_tensor`, concatenated in rank order into `output_tensor`."""
    pg = _group(group)
    if pg is None:
        return None
    work = pg.all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op,
                                     timeout=timeout)
    return _ret(work, async_op)


def all_gather_object(object_list: list, obj: Any, group=None, timeout: TimeoutLike = None) -> None:
    """Fill `object_list` (one slot per rank) with every rank's picklable `obj`."""
    pg = _group(group)
    if pg is None:
        return None
    if len(object_list) != pg.size():
        raise ValueError(
            f"all_gather_object needs an object_list of {pg.size()} slots, got {len(object_list)}."
        )
    object_list[:] = pg.all_gather_object(obj, timeout=timeout)


def broadcast_object_list(object_list: list, src: Optional[int] = None, group=None,
                          timeout: TimeoutLike = None, device: Any = None,
                          group_src: Optional[int] = None) -> None:
    """Replace `object_list`'s items with world rank `src`'s (or group rank `group_src`'s);
    torch's `device` is not needed on the host and not used."""
    pg = _group(group)
    if pg is None:
        return None
    pg.broadcast_object_list(object_list, _peer(pg, src, group_src, "src"), timeout=timeout)


def gather(tensor, gather_list: Optional[list] = None, dst: Optional[int] = None, group=None,
           async_op: bool = False, timeout: TimeoutLike = None,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Collect every rank's `tensor` into `gather_list` on world rank `dst` (or `group_dst`)."""
    pg = _group(group)
    if pg is None:
        return None
    root = _peer(pg, dst, group_dst, "dst")
    return _ret(pg.gather(tensor, gather_list, root, async_op=async_op, timeout=timeout), async_op)


def scatter(tensor, scatter_list: Optional[list] = None, src: Optional[int] = None, group=None,
            async_op: bool = False, timeout: TimeoutLike = None,
            group_src: Optional[int] = None) -> Optional[Work]:
    """World rank `src` (or group rank `group_src`) sends `scatter_list[j]` to group rank j."""
    pg = _group(group)
    if pg is None:
        return None
    root = _peer(pg, src, group_src, "src")
    return _ret(pg.scatter(tensor, scatter_list, root, async_op=async_op, timeout=timeout), async_op)


def reduce_scatter(output, input_list: list, op: ReduceOp = ReduceOp.SUM, group=None,
                   async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Reduce `input_list[j]` across ranks into group rank j's `output`."""
    pg = _group(group)
    if pg is None:
        return None
    return _ret(pg.reduce_scatter(output, input_list, op, async_op=async_op, timeout=timeout), async_op)


def all_to_all(output_tensor_list: list, input_tensor_list: list, group=None,
               async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Send `input_tensor_list[j]` to group rank j; receive into `output_tensor_list[i]`."""
    pg = _group(group)
    if pg is None:
        return None
    return _ret(pg.all_to_all(output_tensor_list, input_tensor_list, async_op=async_op, timeout=timeout), async_op)


def isend(tensor, dst: Optional[int] = None, group=None, tag: int = 0,
          timeout: TimeoutLike = None, group_dst: Optional[int] = None) -> Optional[Work]:
    """Send to world rank `dst` (or group rank `group_dst`) without waiting; returns the Work."""
    pg = _group(group)
    if pg is None:
        return None
    _need_peer(dst, group_dst, "dst")
    return pg.send(tensor, _peer(pg, dst, group_dst, "dst"), tag, async_op=True, timeout=timeout)


def _need_peer(world_rank: Optional[int], group_rank: Optional[int], what: str) -> None:
    if world_rank is None and group_rank is None:
        raise ValueError(f"Pass {what} (a world rank) or group_{what} (a rank of the group).")


def irecv(tensor, src: Optional[int] = None, group=None, tag: int = 0,
          timeout: TimeoutLike = None, group_src: Optional[int] = None) -> Optional[Work]:
    """Receive from world rank `src` (or group rank `group_src`; neither: any) without
    waiting; returns the Work."""
    pg = _group(group)
    if pg is None:
        return None
    local = None if src is None and group_src is None else _peer(pg, src, group_src, "src")
    return pg.recv(tensor, local, tag, async_op=True, timeout=timeout)


def send(tensor, dst: Optional[int] = None, group=None, tag: int = 0,
         timeout: TimeoutLike = None, group_dst: Optional[int] = None) -> None:
    """Send `tensor` to world rank `dst` (or group rank `group_dst`)."""
    work = isend(tensor, dst, group, tag, timeout, group_dst=group_dst)
    if work is not None:
        work.wait()


def recv(tensor, src: Optional[int] = None, group=None, tag: int = 0,
         timeout: TimeoutLike = None, group_src: Optional[int] = None) -> int:
    """Receive into `tensor` from world rank `src` (or group rank `group_src`; neither: any);
    returns the sender's world rank (-1 if not a member)."""
    pg = _group(group)
    if pg is None:
        return -1
    work = irecv(tensor, src, pg, tag, timeout, group_src=group_src)
    work.wait()
    return get_process_group_ranks(pg)[work.source_rank]


def barrier(group=None, async_op: bool = False, device_ids: Any = None,
            timeout: TimeoutLike = None) -> Optional[Work]:
    """Return once every rank of the group has called barrier (torch's `device_ids` is for
    NCCL's device choice and not used)."""
    pg = _group(group)
    if pg is None:
        return None
    return _ret(pg.barrier(async_op=async_op, timeout=timeout), async_op)


def monitored_barrier(group=None, timeout: TimeoutLike = None, wait_all_ranks: bool = False) -> None:
    """A barrier whose rank 0 names the ranks that did not arrive within `timeout`."""
    pg = _group(group)
    if pg is None:
        return None
    pg.monitored_barrier(timeout=timeout, wait_all_ranks=wait_all_ranks)



# ----------------------------------------------------------------------------- torch's others

def reduce_scatter_tensor(output, input, op: ReduceOp = ReduceOp.SUM, group=None,
                          async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """`output` := the reduction of this rank's block of every rank's `input` (W blocks)."""
    pg = _group(group)
    if pg is None:
        return None
    work = pg.reduce_scatter_tensor(output, input, op, async_op=async_op, timeout=timeout)
    return _ret(work, async_op)


def reduce_scatter_single(output, input, op: ReduceOp = ReduceOp.SUM, group=None,
                          async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """torch's newer name of reduce_scatter_tensor."""
    return reduce_scatter_tensor(output, input, op, group, async_op, timeout)


def all_gather_single(output_tensor, input_tensor, group=None, async_op: bool = False,
                      timeout: TimeoutLike = None) -> Optional[Work]:
    """torch's newer name of all_gather_into_tensor."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, timeout)


def _all_gather_base(output_tensor, input_tensor, group=None, async_op: bool = False):
    """torch's older name of all_gather_into_tensor."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def _reduce_scatter_base(output, input, op: ReduceOp = ReduceOp.SUM, group=None,
                         async_op: bool = False):
    """torch's older name of reduce_scatter_tensor."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all_single(output, input, output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None, group=None,
                      async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Rows of `input` in blocks to each rank; theirs into `output` (equal or given splits)."""
    pg = _group(group)
    if pg is None:
        return None
    return _ret(pg.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                     async_op=async_op, timeout=timeout), async_op)


def gather_object(obj: Any, object_gather_list: Optional[list] = None, dst: Optional[int] = None,
                  group=None, timeout: TimeoutLike = None,
                  group_dst: Optional[int] = None) -> None:
    """Every rank's picklable `obj` into `object_gather_list` on world rank `dst` (or group
    rank `group_dst`)."""
    pg = _group(group)
    if pg is None:
        return None
    pg.gather_object(obj, object_gather_list, _peer(pg, dst, group_dst, "dst"), timeout=timeout)


def scatter_object_list(scatter_object_output_list: list,
                        scatter_object_input_list: Optional[list] = None,
                        src: Optional[int] = None, group=None, timeout: TimeoutLike = None,
                        group_src: Optional[int] = None) -> None:
    """World rank `src`'s `scatter_object_input_list[j]` into group rank j's output list [0]."""
    pg = _group(group)
    if pg is None:
        return None
    pg.scatter_object_list(scatter_object_output_list, scatter_object_input_list,
                           _peer(pg, src, group_src, "src"), timeout=timeout)


def all_reduce_coalesced(tensors: Sequence, op: ReduceOp = ReduceOp.SUM, group=None,
                         async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Reduce each tensor in place, with one all_reduce per dtype."""
    pg = _group(group)
    if pg is None:
        return None
    return _ret(pg.all_reduce_coalesced(tensors, op, timeout=timeout), async_op)


def all_gather_coalesced(output_tensor_lists: Sequence[Sequence], input_tensor_list: Sequence,
                         group=None, async_op: bool = False,
                         timeout: TimeoutLike = None) -> Optional[Work]:
    """`output_tensor_lists[r][i]` := group rank r's `input_tensor_list[i]`."""
    pg = _group(group)
    if pg is None:
        return None
    work = pg.all_gather_coalesced(output_tensor_lists, input_tensor_list, timeout=timeout)
    return _ret(work, async_op)


def _make_nccl_premul_sum(factor: float):
    """torch's name for make_premul_sum (shoal's PREMUL_SUM runs on every backend)."""
    return make_premul_sum(factor)


class P2POp:
    """One point-to-point operation for batch_isend_irecv: `P2POp(isend, tensor, peer)`."""

    def __init__(self, op: Callable, tensor, peer: Optional[int] = None, group=None, tag: int = 0,
                 group_peer: Optional[int] = None):
        if op not in (isend, irecv):
            raise ValueError(
                "Invalid op: P2POp expects collectives.isend or collectives.irecv, got "
                f"{getattr(op, '__name__', op)!r}."
            )
        if (peer is None) == (group_peer is None):
            raise ValueError("P2POp needs exactly one of peer (a world rank) and group_peer.")
        self.op = op
        self.tensor = tensor
        self.group = group
        self.tag = tag
        if peer is None:
            pg = _group(group)
            peer = get_process_group_ranks(pg)[group_peer] if pg is not None else -1
        self.peer = peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list:
    """Start every P2POp and return their Works (wait on each), as torch's batch_isend_irecv."""
    ops = list(p2p_op_list)
    if not ops or not all(isinstance(p, P2POp) for p in ops):
        raise ValueError("batch_isend_irecv needs a non-empty list of P2POp.")
    if len({id(_group(p.group)) for p in ops}) != 1:
        raise ValueError("All P2POps of one batch_isend_irecv must use the same group.")
    works = []
    for p in ops:
        work = p.op(p.tensor, p.peer, p.group, p.tag)
        if work is not None:
            works.append(work)
    return works


def send_object_list(object_list: list, dst: Optional[int] = None, group=None,
                     device: Any = None, timeout: TimeoutLike = None,
                     group_dst: Optional[int] = None, use_batch: bool = False) -> None:
    """Send every picklable object of `object_list` to world rank `dst` (torch's
    send_object_list; the receiver passes a list of the same length to recv_object_list)."""
    blobs = [arrays.pickle_to_array(o) for o in object_list]
    data = np.concatenate(blobs) if blobs else np.empty(0, np.uint8)
    for part in (np.array([b.size for b in blobs], dtype=np.int64), data):
        send(part, dst, group, timeout=timeout, group_dst=group_dst)


def recv_object_list(object_list: list, src: Optional[int] = None, group=None,
                     device: Any = None, timeout: TimeoutLike = None,
                     group_src: Optional[int] = None, use_batch: bool = False) -> int:
    """Fill `object_list` with the objects world rank `src` (None: any) sent with
    send_object_list; returns the sender's world rank (-1 if not a member of `group`)."""
    sizes = np.empty(len(object_list), dtype=np.int64)
    sender = recv(sizes, src, group, timeout=timeout, group_src=group_src)
    if sender < 0:
        return sender
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    recv(data, sender, group, timeout=timeout)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(len(object_list)):
        object_list[i] = arrays.array_to_object(data[offsets[i]:offsets[i + 1]])
    return sender
