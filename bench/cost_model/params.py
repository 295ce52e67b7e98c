"""The fitted parameters of the cost model (a path's, memory's, shared memory's) and where the
ranks run (cores, contention)."""

from __future__ import annotations

import dataclasses
from typing import Optional


def contention(procs: int, cores: int) -> float:
    """How much P busy processes on C cores slow a CPU-bound phase: max(1, P/C)."""
    return max(1.0, procs / cores)


@dataclasses.dataclass(frozen=True)
class Link:
    """One path's costs in seconds: latency sleeping and polling, per message, per byte of
    CPU work, and per byte of a wire shared by all rings that cross it (0: no wire limit)."""

    a_block: float
    a_spin: float
    o: float
    beta: float
    wire: float = 0.0
    sw: float = 0.0  # shoal's own work per message (headers, checks, bookkeeping)
    # The fraction of a core one end of a streaming exchange keeps busy: ranks sharing cores
    # slow each other by P x busy / C, not P / C (measured with process_time).
    busy: float = 1.0
    # CPU one end spends per small message it sends and receives when it sleeps between them
    # (a send, a receive and a wake-up: the ping-pong's process time per round trip); None in
    # fits saved before it was measured.
    c_msg: Optional[float] = None

    def latency(self, spin: bool, data: bool = True) -> float:
        """A message's cost before its bytes: its latency, and shoal's work on a data message
        (a barrier's headers measured as cheap as the raw exchange)."""
        # Polling gives up and sleeps after a while (SPIN_S): never slower than sleeping.
        wait = min(self.a_spin, self.a_block) if spin else self.a_block
        return wait + (self.sw if data else 0.0)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-byte costs of a copy (c) and of a float32 add (g), inside the cache and beyond."""

    c_cache: float
    c_mem: float
    g_cache: float
    g_mem: float
    llc_bytes: int

    def rates(self, working_set: float) -> tuple[float, float]:
        """(c, g) for an operation touching `working_set` bytes on one host: cache rates while
        it fits in half the last-level cache (the other half is other work's and the peer
        side's of the bench, which alternates with ours), memory rates beyond."""
        if working_set <= self.llc_bytes / 2:
            return self.c_cache, self.g_cache
        return self.c_mem, self.g_mem


@dataclasses.dataclass(frozen=True)
class ShmCost:
    """shoal's shared-memory path as fitted from its 2-rank all_reduce: a step's barrier and
    bookkeeping per peer (None: a raw unix exchange of headers), and how much slower than the
    copy and add microbenchmarks its per-byte work runs."""

    step: Optional[float] = None
    eta: float = 1.0


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where the ranks run: `cores` per host (None: a core per rank) and whether every rank
    of every host shares this one machine's cores (the namespaces here)."""

    cores: Optional[int]
    one_machine: bool

    def k(self, hosts: int, local: int) -> float:
        """Contention of every rank working: `hosts` x `local` ranks on this machine's cores
        when they share it, else `local` on a host's."""
        if self.cores is None:
            return 1.0
        procs = hosts * local if self.one_machine else local
        return contention(procs, self.cores)

    def k_busy(self, procs_here: int, procs_per_host: int) -> float:
        """Contention when only some ranks work (the leaders of a cross-host phase):
        `procs_here` of them on this machine's cores, `procs_per_host` per cluster host."""
        if self.cores is None:
            return 1.0
        procs = procs_here if self.one_machine else procs_per_host
        return contention(procs, self.cores)

    def leaders(self, hosts: int, local: int) -> int:
        """Leaders per host, as the tcp group picks them: the host's cores per local rank,
        between 1 and the ranks per host (a core per rank: every rank leads)."""
        if self.cores is None:
            return local
        per_host = self.cores  # the namespaces here share this machine's cores
        return max(1, min(local, per_host // max(1, local)))

    def pipelined(self, local: int) -> bool:
        """Whether the group pipelines its two-level all_reduce: two cores per local rank."""
        return self.cores is None or self.cores >= 2 * local

    def spin(self, world: int) -> bool:
        """Whether receivers poll (a^spin) rather than sleep in a group of `world` ranks."""
        # collectives.env.spin_seconds: poll only when every rank of the group has a core
        # (and the tcp group's load check: while the load, its own ranks' included, stays
        # under 1.5 C, which our ranks alone keep here).
        if self.cores is None:
            return True
        return world <= self.cores
