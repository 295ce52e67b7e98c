"""The cost model's formulas (the package docstring's) over fitted parameters: the direct
exchange, rings, recursive doubling, shared memory, and the two-level all_reduce."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .constants import (
    BUCKET_BYTES,
    DIRECT_MAX_RANKS,
    FIRST_BUCKET_BYTES,
    PIPELINE_PIECE_BYTES,
    RING_FILL_BYTES,
    SHM_CHUNK_BYTES,
    SHM_W2_MIN_CHUNK_BYTES,
    SMALL_MAX_BYTES,
)
from .params import Link, Machine, Memory, ShmCost


@dataclasses.dataclass(frozen=True)
class Model:
    """The formulas of the module docstring over fitted parameters."""

    links: dict  # name -> Link: unix, tcp_lo, veth (and "cluster" for predictions)
    memory: Memory
    shm: ShmCost = ShmCost()

    def _shm_rates(self, working_set: float) -> tuple[float, float]:
        c, g = self.memory.rates(working_set)
        return c * self.shm.eta, g * self.shm.eta

    @staticmethod
    def _weighted(links) -> list[tuple[Link, float]]:
        """[(link, how many)] from links given alone (one each) or as (link, count) pairs."""
        return [item if isinstance(item, tuple) else (item, 1.0) for item in links]

    def direct(self, nbytes, peers, k, spin, g) -> float:
        """Direct exchange: a message to and from each peer; `peers` are (link, how many peers
        over it). Every message leaves at once, so the exchange waits one latency (the slowest
        link's) and does every message's work: its CPU (a send, a receive, a wake-up from
        sleep, or the streaming cost `o` when receivers poll), shoal's own work and the bytes;
        or, with more ranks than cores (k > 1), as long as the cores take to do every rank's
        work, k times that, when longer: a core never idles waiting while another rank can
        run. (Fits without `c_msg`: each message's latency in turn, as before.)"""
        links = self._weighted(peers)
        if any(h.c_msg is None for h, _ in links):
            return k * sum(n * (h.latency(spin) + h.o + nbytes * (h.beta + g)) for h, n in links)
        wait = max(h.latency(spin, data=False) for h, _ in links)
        work = sum(n * ((h.o if spin else h.c_msg) + h.sw + nbytes * (h.beta + g))
                   for h, n in links)
        return max(wait + work, k * work)

    def ring(self, nbytes, world, hops, k, spin, g, share: int = 1, peers=None) -> float:
        """A ring (the direct exchange with `peers` for small messages) over `hops`, (link,
        how many hops of the ring use it); `share` rings cross each wire at once.

        A step lasts as long as its slowest hop, or, when P > C, as long as the cores take to
        do every rank's share of the step's work (k times the mean hop's work)."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        hops = self._weighted(hops)
        if nbytes <= SMALL_MAX_BYTES:
            total = sum(n for _, n in hops)
            return self.direct(nbytes, peers or [(h, (world - 1) * n / total) for h, n in hops],
                               k, spin, g)
        seg = nbytes / world
        work = [(h.latency(spin) + h.o + seg * h.beta, n) for h, n in hops]
        total = sum(n for _, n in work)
        mean = sum(w * n for w, n in work) / total
        busy = sum(h.busy * n for h, n in hops) / total
        wire = max(seg * share * h.wire for h, _ in hops)
        cores = max(1.0, k * busy) * mean
        if k > 1:
            # Ranks sharing cores: a rank's neighbour is often descheduled, so it can hand on
            # only what its send buffer holds before it sleeps, and the rest of its segment
            # waits for the scheduler to run the receiver: the step pays for moving
            # min(S/W, send buffer) once more, the pipe's fill (module docstring).
            cores += min(seg, RING_FILL_BYTES) * sum(h.beta * n for h, n in hops) / total
        step = max(cores, max(w for w, _ in work), wire)
        return 2 * (world - 1) * step + k * (world - 1) * seg * g

    def recursive_doubling(self, nbytes, world, link: Link, k, spin, g,
                           local: int = 1, intra: Optional[Link] = None) -> float:
        """shoal's small all_reduce above DIRECT_MAX_RANKS ranks: log2(p) exchanges of S with
        one peer (p the largest power of two <= W), plus a fold in and out beyond p. Ranks go
        host by host, so the exchanges with a partner closer than `local` ranks stay on the
        host (over `intra`) and the others cross `link`."""
        p = 1 << (int(world).bit_length() - 1)

        def one(h: Link) -> float:
            return max(k * (h.latency(spin) + h.o + nbytes * (h.beta + g)), nbytes * h.wire)

        total, mask = 0.0, 1
        while mask < p:
            total += one(intra if intra is not None and mask < local else link)
            mask <<= 1
        if world != p:
            total += 2 * one(link)
        return total

    def _barrier(self, local, k, spin) -> float:
        """A shared-memory step's barrier among `local` ranks: an empty direct exchange, its
        messages' latencies overlapped (module docstring)."""
        unix = self.links["unix"]
        if self.shm.step is not None:
            return k * (self.shm.step + (local - 2) * unix.o)
        return k * (unix.latency(spin, data=False) + (local - 1) * unix.o)

    def one_host(self, nbytes, local, machine: Machine, hosts_here: int = 1) -> float:
        """shoal's same-host all_reduce of `local` ranks: direct over unix for small messages,
        else shared memory (shm.py)."""
        if local <= 1:
            return 0.0
        k, spin = machine.k(hosts_here, local), machine.spin(local * hosts_here)
        if nbytes <= SMALL_MAX_BYTES:
            g = self.memory.rates(2 * local * nbytes)[1]
            return self.direct(nbytes, [(self.links["unix"], local - 1)], k, spin, g)
        c, g = self._shm_rates(2 * local * nbytes)
        b = self._barrier(local, k, spin)
        if local == 2:
            chunk = min(SHM_CHUNK_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, nbytes // 4))
            return math.ceil(nbytes / chunk) * b + k * nbytes * (c + g)
        m = math.ceil(nbytes / SHM_CHUNK_BYTES)
        return (m + 1) * b + k * ((2 * nbytes - nbytes / local) * c
                                  + (local - 1) * nbytes / local * g)

    def hierarchical(self, nbytes, hosts, local, link: Link, intra: Link,
                     machine: Machine) -> float:
        """T1 + T2 + T3 of the module docstring, with the group's leaders per host (k) and,
        where it pipelines, the phases overlapped; small messages: the flat direct exchange,
        or above DIRECT_MAX_RANKS ranks the two-level tree."""
        if hosts <= 1:
            return self.one_host(nbytes, local, machine)
        if local <= 1:
            return self.flat(nbytes, hosts, local, link, intra, machine)
        if nbytes <= SMALL_MAX_BYTES:
            return self.flat(nbytes, hosts, local, link, intra, machine)
        k, spin = machine.k(hosts, local), machine.spin(hosts * local)
        leaders = machine.leaders(hosts, local)
        working_set = 2 * local * nbytes * (hosts if machine.one_machine else 1)
        c, g = self._shm_rates(working_set)
        b = self._barrier(local, k, spin)
        seg = nbytes / leaders
        # (1) every rank publishes the other owners' segments; an owner reduces its segment
        # from the L-1 peers' regions (its work is the longest).
        t1 = (math.ceil(nbytes / SHM_CHUNK_BYTES) * b
              + k * ((nbytes - seg) * c + (local - 1) * seg * g))
        # (2) k rings at once, each over the H leaders of one local index; only the leaders
        # work, so the contention counts them alone.
        k2 = machine.k_busy(hosts * leaders, leaders)
        t2 = self.ring(seg, hosts, [link], k2, spin, self.memory.rates(working_set)[1],
                       share=leaders)
        # (3) every rank copies the owners' segments out of their regions.
        relay = min(SHM_CHUNK_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, seg // 4))
        t3 = math.ceil(seg / relay) * b + k * nbytes * c
        pieces = math.ceil(nbytes / PIPELINE_PIECE_BYTES)
        if machine.pipelined(local) and pieces > 1:
            # The courier carries piece j while the host works on j+1 and j-1: the longer of
            # the two streams decides, plus one piece of each to fill and drain the pipe.
            return max(t1 + t3, t2) + (t1 + t2 + t3) / pieces
        return t1 + t2 + t3

    def flat(self, nbytes, hosts, local, link: Link, intra: Link, machine: Machine) -> float:
        """Every rank in one ring over sockets (direct exchange for small messages): hops
        between hosts over `link`, within one over `intra`; one host runs its own path."""
        if hosts <= 1:
            return self.one_host(nbytes, local, machine)
        k, spin = machine.k(hosts, local), machine.spin(hosts * local)
        _, g = self.memory.rates(2 * local * nbytes * (hosts if machine.one_machine else 1))
        # Ranks in host order: H hops of the ring cross hosts, H (L-1) stay within one; each
        # rank has L-1 peers on its host and W-L elsewhere for the direct exchange.
        world = hosts * local
        if nbytes <= SMALL_MAX_BYTES and world > DIRECT_MAX_RANKS:
            return self.recursive_doubling(nbytes, world, link, k, spin, g, local, intra)
        hops = [(link, hosts)] + ([(intra, hosts * (local - 1))] if local > 1 else [])
        peers = [(link, world - local)] + ([(intra, local - 1)] if local > 1 else [])
        return self.ring(nbytes, world, hops, k, spin, g, peers=peers)


def bucket_sizes(nbytes: int) -> list[int]:
    """shoal DDP's gradient buckets for `nbytes` of gradients: 1 MiB first, then 25 MiB."""
    out, left, cap = [], nbytes, FIRST_BUCKET_BYTES
    while left > 0:
        out.append(min(left, cap))
        left -= out[-1]
        cap = BUCKET_BYTES
    return out


def bandwidth_bound(nbytes: float, world: int, bandwidth: float) -> float:
    """The bandwidth-optimal all_reduce time 2 (W-1)/W x S / B (seconds; B in bytes/s)."""
    return 2 * (world - 1) / world * nbytes / bandwidth if world > 1 else 0.0
