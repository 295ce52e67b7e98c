"""What the ranks of a new tcp group agree on before its first collective: shared memory when
every rank is on this host (`shared_memory`), or the two-level plan when the group spans hosts
(`hierarchy`). Every rank takes the same path, or nobody does."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from shoal.collectives import env
from shoal.collectives.backends.tcp import hierarchical, shm
from shoal.collectives.backends.tcp import topology as topo
from shoal.collectives.backends.tcp.links import Links
from shoal.collectives.backends.tcp.mesh import Mesh
from shoal.collectives.constants import SHM_SLOT_BYTES
from shoal.collectives.types import CollectiveError

logger = logging.getLogger(__name__)

__all__ = ["CPUS", "hierarchy", "shared_memory"]

try:
    CPUS = len(os.sched_getaffinity(0))  # the cores this process may run on
except (AttributeError, OSError):
    CPUS = os.cpu_count() or 1
# Setup waits at most this long for a peer, however long the group's timeout.
_SETUP_TIMEOUT_CAP_S = 60.0


def _leaders_proposal(topology: topo.Topology, local_size: int) -> int:
    """How many ranks per host this rank proposes to carry traffic between hosts.

    SHOAL_HIER_LEADERS when set; else the host's cores per local rank, within 1 and the
    smallest host's rank count: each leader's ring needs CPU for its socket copies on top of
    what the host's ranks use. Measured on 2 cores, 2 hosts x 2 ranks, 64 MiB (quiet, under
    SCHED_FIFO): one leader per host 62 ms, two 74 ms (their rings' copies compete for the
    same cores).
    """
    configured = env.hierarchical_leaders()
    if configured is not None:
        return configured
    return max(1, min(min(len(h) for h in topology.hosts), CPUS // max(1, local_size)))


def _pipeline_proposal(local_size: int) -> bool:
    """Whether this rank proposes to pipeline two-level all_reduces: SHOAL_HIER_PIPELINE when
    set, else when the host has two cores per local rank (a leader's courier thread then has a
    core of its own). Overlap needs spare cores: on 2 cores with 2 ranks per host the pipeline
    measured 79 ms against 62 ms unpipelined (2 hosts x 2 ranks, 64 MiB), since the leaders
    already keep both cores busy and the pipeline adds barriers and thread hand-offs."""
    configured = env.hierarchical_pipeline()
    if configured is not None:
        return configured
    return CPUS >= 2 * local_size


def shared_memory(mesh: Mesh, name: str, timeout: float) -> Optional[shm.SharedSlots]:
    """Shared memory for large all_reduces when every rank of the group shares our host.

    Raises:
        CollectiveError: a peer broke the setup (it names the peer).
    """
    rank, size = mesh.rank, mesh.size
    if size < 2 or any(t != "unix" for q, t in enumerate(mesh.transports) if q != rank):
        return None
    # Every all-Unix group runs the setup, offering nothing unless this rank's mode is
    # "shm": ranks started with different SHOAL_LOCAL_TRANSPORT values then agree on
    # sockets instead of one side waiting for offers the other never sends.
    try:
        return shm.SharedSlots.establish(
            rank, size, mesh.tx, mesh.rx, SHM_SLOT_BYTES, min(timeout, _SETUP_TIMEOUT_CAP_S),
            offer=env.local_transport() == "shm",
        )
    except shm.ShmSetupError as exc:
        raise CollectiveError(
            f"Rank {rank} of group '{name}' could not set up shared memory with "
            f"{exc}; set SHOAL_LOCAL_TRANSPORT=unix to use sockets only."
        ) from exc


def _host_links(links: Links, members: tuple[int, ...], willing: bool, name: str,
                timeout: float) -> Links:
    """Links among this host's ranks, with shared memory when every one of them offers it."""
    local = links.subset(list(members), label="host")
    try:
        local.shm = shm.SharedSlots.establish(
            local.rank, local.size, local.tx, local.rx, SHM_SLOT_BYTES,
            min(timeout, _SETUP_TIMEOUT_CAP_S), offer=willing,
        )
    except shm.ShmSetupError as exc:
        raise CollectiveError(
            f"Rank {links.rank} of group '{name}' could not set up shared memory "
            f"with rank {members[exc.peer]}: {exc.detail}; set SHOAL_LOCAL_TRANSPORT=unix to "
            "use sockets only."
        ) from exc
    return local


def hierarchy(topology: topo.Topology, links: Links, name: str, timeout: float
              ) -> tuple[topo.Topology, Optional[hierarchical.Plan]]:
    """The two-level plan for a group that spans hosts: shared memory among this host's
    ranks, and links to the ranks with our local index on the other hosts. Every rank of
    the group agrees on using it, or nobody does (a host whose shared memory failed, or a
    rank run with SHOAL_LOCAL_TRANSPORT=unix or SHOAL_HIERARCHICAL=0, means flat
    algorithms everywhere). Returns the topology with the agreed leaders, and the plan (None:
    flat).

    Raises:
        CollectiveError: a rank of this host broke the shared-memory setup.
    """
    rank = links.rank
    local_members = topology.local_ranks(rank)
    index = local_members.index(rank)
    willing = env.local_transport() == "shm" and env.hierarchical_collectives()
    local = None
    if len(local_members) > 1:
        local = _host_links(links, local_members, willing, name, timeout)
        willing = willing and local.shm is not None
    # Every rank must take the same path with the same leaders: each says whether it can
    # and how many leaders per host it proposes; the smallest proposal wins.
    # Likewise whether all_reduce pipelines its pieces (every rank must cut the same).
    ours = bytes([int(willing), min(255, _leaders_proposal(topology, len(local_members))),
                  int(_pipeline_proposal(len(local_members)))])
    verdicts = [ours] + [bytes(v) for v in links.direct.exchange(0, b"hierarchy", ours).values()]
    topology = dataclasses.replace(topology, max_leaders=min(v[1] for v in verdicts))
    pipelined = all(v[2] == 1 for v in verdicts)
    if not all(v[0] == 1 for v in verdicts):
        if local is not None:
            local.shm = None
        logger.info("Group %r spans hosts (%s) but runs flat collectives: a rank cannot use "
                    "shared memory", name, topology.describe())
        return topology, None
    k = topology.leaders_per_host
    cross = (links.subset(list(topology.cross_ranks(index)), label=f"ring{index}")
             if index < k else None)
    return topology, hierarchical.Plan(topology, topology.host_of(rank), index, local, cross,
                                       pipelined)
