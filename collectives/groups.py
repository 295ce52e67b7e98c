"""Forming and leaving process groups: `init_process_group`, `new_group` and its subgroup
helpers, `destroy_process_group`, and `register_backend`, as in `torch.distributed`.

Backends are found by name in a registry (`backends.registry`) and imported only when used:
"tcp" (alias "gloo") and "nccl".
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

from shoal.collectives import env, profiler_clock
from shoal.collectives.api import ProcessGroup
from shoal.collectives.backends import registry
from shoal.collectives.constants import DEFAULT_GROUP_NAME
from shoal.collectives.init_method import check_rank_and_size, rank_or_none, store_for
from shoal.collectives.store.api import Store
from shoal.collectives.types import DEFAULT_COLLECTIVE_TIMEOUT_S, CollectiveError
from shoal.collectives.world import GroupMember, get_default_group, get_world_size, state
from shoal.core.timeouts import TimeoutLike, to_seconds

logger = logging.getLogger(__name__)


def register_backend(name: str, target: Union[str, Callable[..., ProcessGroup]]) -> None:
    """Make `init_process_group(backend=name)` use `target` ("module:Class" or a callable)."""
    registry.register_backend(name, target)


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
    with state.lock:
        if state.default is not None:
            raise CollectiveError(
                "init_process_group was called twice; call destroy_process_group() first."
            )
        cls = registry.backend_class(backend)
        rank_, size_ = rank_or_none(rank), rank_or_none(world_size)
        own_store = store is None
        if store is None:
            store, rank_, size_ = store_for(init_method or "env://", rank_, size_, seconds)
        elif init_method is not None:
            raise ValueError("Pass either init_method or store to init_process_group, not both.")
        elif rank_ is None or size_ is None:
            raise ValueError(
                "init_process_group with store= needs rank= and world_size= (rank in "
                f"[0, world_size), world_size >= 1); got rank={rank!r} and "
                f"world_size={world_size!r} (-1 means not given)."
            )
        else:
            check_rank_and_size(rank_, size_, "given with store=")
        kwargs = dict(timeout=seconds, name=group_name, global_ranks=list(range(size_)))
        if host is not None:
            kwargs["host"] = host
        try:
            pg = cls(store, rank_, size_, **kwargs)
        except BaseException:
            if own_store:
                store.close()
            raise
        state.default = pg
        state.store = store
        state.own_store = own_store
        state.backend = registry.canonical_name(backend)
        state.rank = rank_
        state.size = size_
        state.timeout = seconds
        state.groups = {pg: list(range(size_))}
        state.backend_names = {pg: registry.Backend(backend or registry.DEFAULT_BACKEND)}
        state.group_count = 0
        profiler_clock.lend_store(pg)
        logger.debug("Rank %d joined the default group of %d ranks (%s)", rank_, size_, state.backend)
        return pg


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
    with state.lock:
        get_default_group()
        state.group_count += 1
        ranks = list(range(state.size)) if ranks is None else sorted(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < state.size for r in ranks):
            raise ValueError(
                f"new_group ranks must be distinct world ranks in 0..{state.size - 1}, got {ranks}."
            )
        name = group_name or f"group{state.group_count}"
        if state.rank not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        cls = registry.backend_class(backend or state.backend)
        seconds = to_seconds(timeout, state.timeout)
        pg = cls(state.store, ranks.index(state.rank), len(ranks), timeout=seconds, name=name,
                 global_ranks=ranks)
        state.groups[pg] = ranks
        state.backend_names[pg] = (registry.Backend(backend) if backend
                                    else state.backend_names[state.default])
        return pg


def destroy_process_group(group=None) -> None:
    """Leave `group`, or with None every group and the default one (closing its store)."""
    with state.lock:
        if group is GroupMember.NON_GROUP_MEMBER:
            return
        if group is not None and group is not state.default:
            group.shutdown()
            state.groups.pop(group, None)
            state.backend_names.pop(group, None)
            return
        if state.default is None:
            return
        profiler_clock.take_back_store(state.default)
        for pg in list(state.groups):
            try:
                pg.shutdown()
            except Exception:  # keep tearing down the rest
                logger.exception("Shutting down group %r failed", pg.name)
        if state.own_store and state.store is not None:
            state.store.close()
        state.reset()
