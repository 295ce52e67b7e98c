"""`hybrid_mesh()`: the (replicate, shard) groups of hybrid sharding, shard groups within a host.

torch builds them as a 2-D DeviceMesh (`init_device_mesh("cpu", (hosts, per_host))`); here they
are two process groups, which `fully_shard(mesh=(replicate, shard))` takes. Within a host the tcp
backend runs the shard group's all_gathers and reduce_scatters over shared memory; only the
replicate group's all_reduce of the (1/per_host-sized) gradient shards crosses hosts.
"""

from __future__ import annotations

import socket
from typing import Any, Optional

from shoal.collectives.groups import new_subgroups_by_enumeration
from shoal.collectives.object_collectives import all_gather_object
from shoal.collectives.world import get_world_size

__all__ = ["hybrid_mesh"]


def hybrid_mesh(shard_size: Optional[int] = None) -> tuple[Any, Any]:
    """(replicate group, shard group) of this rank; every rank of the world calls it.

    shard_size: ranks per shard group, taken consecutively (shoal run and torchrun number a
    host's ranks consecutively); None groups the ranks by the host they run on, which needs
    every host to run the same number of ranks.

    Raises:
        ValueError: shard_size does not divide the world, or the hosts run unequal numbers of
            ranks.
    """
    world = get_world_size()
    if shard_size is None:
        hosts: list = [None] * world
        all_gather_object(hosts, socket.gethostname())
        by_host: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            by_host.setdefault(host, []).append(rank)
        shards = list(by_host.values())
        if len({len(s) for s in shards}) != 1:
            raise ValueError(f"hybrid_mesh: the hosts run unequal numbers of ranks "
                             f"({ {h: len(r) for h, r in by_host.items()} }); pass shard_size.")
    else:
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 \
                or world % shard_size:
            raise ValueError(f"hybrid_mesh: shard_size must divide the world size {world}, got "
                             f"{shard_size!r}.")
        shards = [list(range(h, h + shard_size)) for h in range(0, world, shard_size)]
    replicas = [[s[i] for s in shards] for i in range(len(shards[0]))]
    shard, _ = new_subgroups_by_enumeration(shards)
    replicate, _ = new_subgroups_by_enumeration(replicas)
    return replicate, shard
