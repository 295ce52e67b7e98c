"""This process's world: the default group and the groups made from it, and what can be asked
of them (ranks, sizes, backends, membership), as `torch.distributed` answers.

Ranks given to these functions are world ranks, as in torch; `ProcessGroup` methods take the
group's own ranks, and `group_peer` turns the one into the other for the module-level calls.
"""

from __future__ import annotations

import threading
from typing import Optional

from shoal.collectives import env
from shoal.collectives.api import ProcessGroup
from shoal.collectives.backends import registry
from shoal.collectives.store.api import Store
from shoal.collectives.types import DEFAULT_COLLECTIVE_TIMEOUT_S, CollectiveError


class _NonMember:
    """What `new_group` returns on ranks outside the group (collectives on it do nothing)."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class _WorldAttribute(type):
    # torch's GroupMember.WORLD and group.WORLD read the default group at the time of asking
    # (None before init_process_group); a metaclass property gives the class that attribute.
    @property
    def WORLD(cls) -> Optional[ProcessGroup]:  # noqa: N802 - torch's attribute name
        """The default group, None before init_process_group."""
        return state.default


class GroupMember(metaclass=_WorldAttribute):
    """torch's names for the default group (`WORLD`) and for "not in this group"."""

    NON_GROUP_MEMBER = _NonMember()


class group(metaclass=_WorldAttribute):  # noqa: N801 - torch's name: dist.group.WORLD
    """`group.WORLD`: the default group, as torch.distributed.group.WORLD."""


class WorldState:
    """This process's default group, its store and the groups made from it (one per process)."""

    def __init__(self) -> None:
        # One lock for the life of the process: init, new_group and destroy hold it while they
        # change the fields below, so a reset must not swap it for another.
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        """Forget every group: the state before init_process_group."""
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


state = WorldState()


def is_initialized() -> bool:
    """True between init_process_group and destroy_process_group."""
    return state.default is not None


def get_default_group() -> ProcessGroup:
    """The default (world) group.

    Raises:
        CollectiveError: init_process_group has not been called.
    """
    pg = state.default
    if pg is None:
        raise CollectiveError(
            "The default process group is not initialized; call collectives.init_process_group() first."
        )
    return pg


def member_group(group) -> Optional[ProcessGroup]:
    """`group` checked, None meaning the default group; None back on a rank outside `group`."""
    if group is None:
        return get_default_group()
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}.")
    return group


def _local(group: ProcessGroup, world_rank: int, what: str) -> int:
    ranks = state.groups.get(group)
    if ranks is None:
        ranks = getattr(group, "global_ranks", None) or list(range(group.size()))
    try:
        return ranks.index(world_rank)
    except ValueError:
        raise ValueError(
            f"{what} {world_rank} is not a member of group '{group.name}' (its ranks: {ranks})."
        ) from None


def group_peer(pg: ProcessGroup, world_rank: Optional[int], group_rank: Optional[int],
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
    pg = member_group(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group=None) -> int:
    """Number of ranks in `group` (default: the world); -1 if this rank is not a member."""
    pg = member_group(group)
    return -1 if pg is None else pg.size()


def get_backend(group=None) -> str:
    """The name `group`'s backend was asked for by ("gloo", "tcp", "nccl"), as torch answers.

    Raises:
        ValueError: this rank is not a member of `group`.
    """
    pg = member_group(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this rank is not a member of it.")
    name = state.backend_names.get(pg)
    if name is None:  # a group made outside init_process_group/new_group
        name = registry.Backend(getattr(pg, "backend_name", state.backend))
    return name


def get_process_group_ranks(group) -> list[int]:
    """World ranks of `group`'s members."""
    pg = member_group(group)
    return list(state.groups.get(pg, range(pg.size())))


def _member_group_ranks(group) -> tuple:
    """`group` (None: the default) and its world ranks; a group this rank is not in is refused."""
    pg = member_group(group)
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
