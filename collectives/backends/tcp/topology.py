"""Which ranks of a group share a host, learned from the store the group met through.

Every rank of a tcp group publishes its host identity (kernel boot id and network namespace,
see `wire.host_identity`) in the store beside its Unix-socket address when it sets up its
links; the launcher's rendezvous store is where every rank of a job meets, so the same keys
tell every rank the whole layout. Ranks forced onto TCP (SHOAL_LOCAL_TRANSPORT=tcp) publish no
identity and count as alone on their host.

Hosts are ordered by their lowest rank and each host's ranks by rank, so every rank computes
the same `Topology`. A host's first rank is its leader: local rank 0 under `shoal run`, whose
ranks are numbered host after host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Topology", "from_identities"]


@dataclass(frozen=True)
class Topology:
    """The hosts of a group: `hosts[h]` lists the group ranks on host h, in rank order."""

    hosts: tuple[tuple[int, ...], ...]
    max_leaders: Optional[int] = None  # at most this many leaders per host (None: no limit)

    @property
    def size(self) -> int:
        """How many ranks the hosts hold."""
        return sum(len(h) for h in self.hosts)

    def host_of(self, rank: int) -> int:
        """The index of `rank`'s host."""
        for h, members in enumerate(self.hosts):
            if rank in members:
                return h
        raise ValueError(f"rank {rank} is not in this topology")

    def local_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks that share `rank`'s host (itself included)."""
        return self.hosts[self.host_of(rank)]

    def local_index(self, rank: int) -> int:
        """`rank`'s place among its host's ranks (0 for the leader)."""
        return self.local_ranks(rank).index(rank)

    def leader(self, rank: int) -> int:
        """The leader of `rank`'s host (its lowest rank)."""
        return self.local_ranks(rank)[0]

    @property
    def spans_hosts(self) -> bool:
        """The group has ranks on more than one host."""
        return len(self.hosts) > 1

    @property
    def single_host(self) -> bool:
        """Every rank of the group is on one host."""
        return len(self.hosts) == 1

    @property
    def leaders_per_host(self) -> int:
        """How many ranks per host carry traffic across hosts: as many as the smallest host has,
        so that every cross-host ring has one member on each host."""
        k = min(len(h) for h in self.hosts)
        return k if self.max_leaders is None else max(1, min(k, self.max_leaders))

    @property
    def uniform(self) -> bool:
        """Every host has the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    @property
    def every_rank_leads(self) -> bool:
        """Hosts of equal size whose every rank is in a cross-host ring (what all_gather and
        reduce_scatter need to split their blocks among the rings)."""
        return self.uniform and self.leaders_per_host == len(self.hosts[0])

    @property
    def hierarchical(self) -> bool:
        """Whether a two-level algorithm differs from the flat one: several hosts, and some
        host with more than one rank."""
        return self.spans_hosts and any(len(h) > 1 for h in self.hosts)

    def cross_ranks(self, index: int) -> tuple[int, ...]:
        """The ranks with local index `index` on every host (one cross-host ring)."""
        return tuple(h[index] for h in self.hosts)

    def describe(self) -> str:
        """The hosts' ranks for a message: "0,1 | 2,3"."""
        return " | ".join(",".join(map(str, h)) for h in self.hosts)


def from_identities(identities: Sequence[Optional[str]],
                    max_leaders: Optional[int] = None) -> Topology:
    """The topology of ranks whose host identities are `identities` (None or "": a rank that
    shares its host with no one)."""
    by_identity: dict[str, list[int]] = {}
    hosts: list[list[int]] = []
    for rank, ident in enumerate(identities):
        if not ident:
            hosts.append([rank])
            continue
        members = by_identity.get(ident)
        if members is None:
            members = by_identity[ident] = []
            hosts.append(members)
        members.append(rank)
    hosts.sort(key=lambda h: h[0])
    return Topology(tuple(tuple(h) for h in hosts), max_leaders)
