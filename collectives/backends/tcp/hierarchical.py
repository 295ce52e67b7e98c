"""Two-level collectives for groups whose ranks span hosts: shared memory within each host,
TCP between hosts, carried by several leaders per host at once.

With H hosts of L ranks, a flat TCP ring makes every byte of a large all_reduce cross the
sockets 2(W-1)/W times on every rank, even between ranks on one host. Here (the scheme of
NCCL's and Horovod's hierarchical all_reduce):

1. within each host, a shared-memory reduce-scatter: local rank i reduces segment i of the
   array over the ranks of its host (`shm_streams.reduce_scatter`);
2. between hosts, k concurrent rings: ring i joins local rank i of every host and all-reduces
   segment i over TCP (`over_sockets.all_reduce`), so each rank sends about 2(H-1)/H of S/k
   bytes instead of 2(W-1)/W of S, and k sockets share each host's link;
3. within each host, a shared-memory all-gather of the k reduced segments.

k, the leaders per host, is the smallest host's rank count (every cross-host ring needs a
member on every host); with unequal hosts the ranks beyond k only take part within their host.
broadcast, all_gather and reduce_scatter follow the same pattern (see each function). Every
output element is computed by exactly one rank and copied to the others, so all ranks agree
bitwise, as the flat algorithms do; the order of a reduction differs from the flat ring's,
so the two differ in the last bits of a float sum.

Each phase runs on a `Links.subset` of the group's links: `local` (the host's ranks, with
their shared memory) and `cross` (ring i). Both reuse the group's authenticated sockets and
header checks, so a mismatched call or a dead peer fails the group as before, naming the
group rank (`Links.renumbered`).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp import over_sockets, shm_streams
from shoal.collectives.backends.tcp.links import GroupFailed, Links
from shoal.collectives.backends.tcp.topology import Topology
from shoal.collectives.constants import LINK_REASON_GRACE_S, PIPELINE_PIECE_BYTES

__all__ = ["Plan", "all_reduce", "broadcast", "all_gather", "reduce_scatter"]


@dataclass
class Plan:
    """This rank's place in the two levels."""

    topology: Topology
    host: int  # index of this rank's host in topology.hosts
    index: int  # this rank's index on its host
    local: Optional[Links]  # the host's ranks with their shared memory; None when alone
    cross: Optional[Links]  # ring `index` across hosts; None when index >= leaders per host
    pipelined: bool = False  # all_reduce overlaps its phases (agreed by every rank)
    courier: Any = field(default=None, repr=False)  # a leader's `_Courier`, started on first use

    def close(self) -> None:
        """Stop the leader's courier thread, if it started."""
        if self.courier is not None:
            self.courier.close()

    @property
    def leaders(self) -> int:
        """How many ranks per host carry traffic between hosts."""
        return self.topology.leaders_per_host

    @property
    def local_size(self) -> int:
        """How many ranks share this rank's host."""
        return len(self.topology.hosts[self.host])


def _as_u8(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1).view(np.uint8)


class _Courier:
    """The thread that runs a leader's cross-host rings, so that its host's shared-memory
    phases of the next piece overlap them (see `all_reduce`). One job at a time, in order."""

    def __init__(self, name: str):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _await(job: concurrent.futures.Future, links: Links) -> None:
    """The job's outcome (its exception re-raised); a failed group stops the wait: its links
    are broken, so the job ends soon after with the error that says why."""
    while True:
        try:
            job.result(timeout=1.0)
            return
        except concurrent.futures.TimeoutError:
            if links.failed():
                job.result(timeout=LINK_REASON_GRACE_S)
                raise GroupFailed()


def all_reduce(plan: Plan, flat: np.ndarray, uf, seq: int, fp: bytes,
               avg_over: Optional[int] = None) -> None:
    """flat (1-D) := its reduction over the group, in place; divided by `avg_over` if given.

    When the group pipelines (`plan.pipelined`, hosts with a core to spare per rank), large
    arrays go in pieces: while a leader's courier thread carries piece j between hosts, the
    host's ranks reduce piece j+1 and share piece j-1 through shared memory, so the transfer
    between hosts hides the shared-memory work. Without spare cores the overlap only adds
    barriers and thread hand-offs, and the phases run one after the other.
    """
    step = max(1, PIPELINE_PIECE_BYTES // flat.itemsize) if plan.pipelined else flat.size
    pieces = algos.chunks(0, flat.size, max(1, step))
    owned = plan.index < plan.leaders
    # Every rank cuts the same pieces (each ring's members must agree on its messages); a
    # rank alone on its host has nothing to overlap and carries them one after the other.
    if len(pieces) <= 1 or plan.local is None:
        for lo, hi in pieces:
            _reduce_piece(plan, flat[lo:hi], uf, seq, fp)
            if owned:
                _cross_piece(plan, flat[lo:hi], uf, seq, fp, avg_over)
            _share_piece(plan, flat[lo:hi], seq, fp)
        return
    if owned and plan.courier is None:
        plan.courier = _Courier(f"shoal-pg-{plan.cross.name}-courier")
    jobs: list = []
    for j in range(len(pieces) + 1):
        if j < len(pieces):
            lo, hi = pieces[j]
            _reduce_piece(plan, flat[lo:hi], uf, seq, fp)
            if owned:
                jobs.append(plan.courier.submit(_cross_piece, plan, flat[lo:hi], uf, seq, fp,
                                                avg_over))
        if j >= 1:
            lo, hi = pieces[j - 1]
            if owned:
                _await(jobs[j - 1], plan.cross)
            _share_piece(plan, flat[lo:hi], seq, fp)


def _reduce_piece(plan: Plan, flat: np.ndarray, uf, seq: int, fp: bytes) -> None:
    """Within the host: leader i := the host's reduction of segment i of `flat`."""
    local = plan.local
    if local is None:
        return
    k, li = plan.leaders, plan.index
    b = algos.bounds(flat.size, k)
    lengths = [b[j + 1] - b[j] if j < k else 0 for j in range(local.size)]
    sends = {j: [flat[b[j]:b[j + 1]]] for j in range(min(k, local.size)) if j != li}
    with local.renumbered():
        shm_streams.reduce_scatter(local.shm, local.shm_barrier(seq, fp), uf, flat.dtype,
                                   lengths, sends, [flat[b[li]:b[li + 1]]] if li < k else [])


def _cross_piece(plan: Plan, flat: np.ndarray, uf, seq: int, fp: bytes,
                 avg_over: Optional[int]) -> None:
    """Between hosts (leaders only): segment i of `flat` := its reduction over ring i."""
    b = algos.bounds(flat.size, plan.leaders)
    segment = flat[b[plan.index]:b[plan.index + 1]]
    with plan.cross.renumbered():
        over_sockets.all_reduce(plan.cross, segment, uf, seq, fp)
    if avg_over is not None and segment.size:
        np.divide(segment, segment.dtype.type(avg_over), out=segment)


def _share_piece(plan: Plan, flat: np.ndarray, seq: int, fp: bytes) -> None:
    """Within the host: every rank copies the leaders' reduced segments of `flat`."""
    local = plan.local
    if local is None:
        return
    k, li = plan.leaders, plan.index
    b = algos.bounds(flat.size, k)
    item = flat.itemsize
    lengths = [(b[j + 1] - b[j]) * item if j < k else 0 for j in range(local.size)]
    wants = {j: [(0, _as_u8(flat[b[j]:b[j + 1]]))] for j in range(min(k, local.size)) if j != li}
    with local.renumbered():
        shm_streams.relay(local.shm, local.shm_barrier(seq, fp), lengths,
                          [_as_u8(flat[b[li]:b[li + 1]])] if li < k else None, wants,
                          shm_streams.step_bytes(flat.nbytes // max(1, k)))


def broadcast(plan: Plan, seq: int, fp: bytes, raw: np.ndarray, src: int) -> None:
    """raw (uint8) := rank `src`'s, on every rank.

    On the root's host the root shares the whole array through shared memory; then ring i
    carries segment i from the root's host to every other host (a chain); there the k
    segments are shared through shared memory.
    """
    topo = plan.topology
    root_host = topo.host_of(src)
    k, li = plan.leaders, plan.index
    b = algos.bounds(raw.size, k)
    local = plan.local
    on_root_host = plan.host == root_host
    if on_root_host and local is not None:
        root_index = topo.hosts[root_host].index(src)
        lengths = [raw.size if j == root_index else 0 for j in range(local.size)]
        with local.renumbered():
            shm_streams.relay(local.shm, local.shm_barrier(seq, fp), lengths,
                              [raw] if li == root_index else None,
                              {} if li == root_index else {root_index: [(0, raw)]},
                              shm_streams.step_bytes(raw.size))
    if li < k:
        segment = memoryview(raw[b[li]:b[li + 1]])
        with plan.cross.renumbered():
            over_sockets.broadcast(plan.cross, seq, fp, segment, root_host)
    if not on_root_host and local is not None:
        lengths = [b[j + 1] - b[j] if j < k else 0 for j in range(local.size)]
        wants = {j: [(0, raw[b[j]:b[j + 1]])] for j in range(min(k, local.size)) if j != li}
        with local.renumbered():
            shm_streams.relay(local.shm, local.shm_barrier(seq, fp), lengths,
                              [raw[b[li]:b[li + 1]]] if li < k else None, wants,
                              shm_streams.step_bytes(raw.size // max(1, k)))


def _assigned(plan: Plan, leader: int) -> list[int]:
    """The local indices whose blocks leader `leader` carries between hosts (j % k == leader)."""
    return list(range(leader, plan.local_size, plan.leaders))


def all_gather(plan: Plan, seq: int, fp: bytes, outs: Sequence[np.ndarray]) -> None:
    """outs[q] (uint8, equal sizes) := rank q's block, on every rank; outs[rank] holds ours.

    Hosts of equal size: leader i first collects the blocks of the local ranks it carries
    (local index j with j % k == i) through shared memory; ring i gathers those across hosts
    over TCP, one pass per carried index; then each host's ranks copy everything the leaders
    brought out of their regions.
    """
    topo = plan.topology
    hosts, li, k = topo.hosts, plan.index, plan.leaders
    local = plan.local
    me_host = hosts[plan.host]
    if local is not None and k < local.size:
        lengths = [0 if j < k else outs[0].size for j in range(local.size)]
        wants = ({j: [(0, outs[me_host[j]])] for j in _assigned(plan, li) if j != li}
                 if li < k else {})
        with local.renumbered():
            shm_streams.relay(local.shm, local.shm_barrier(seq, fp), lengths,
                              [outs[me_host[li]]] if li >= k else None, wants,
                              shm_streams.step_bytes(outs[0].size))
    if li < k:
        with plan.cross.renumbered():
            for j in _assigned(plan, li):
                over_sockets.all_gather(plan.cross, seq, fp,
                                        [memoryview(outs[h[j]]) for h in hosts])
    if local is not None:
        def carried(i: int) -> list[int]:
            return [h[j] for j in _assigned(plan, i) for h in hosts]

        per_rank = outs[0].size
        lengths = [per_rank * len(carried(i)) if i < k else 0 for i in range(local.size)]
        wants = {}
        for i in range(min(k, local.size)):
            if i != li:
                wants[i] = [(n * per_rank, outs[q]) for n, q in enumerate(carried(i))
                            if q != me_host[li]]
        with local.renumbered():
            shm_streams.relay(local.shm, local.shm_barrier(seq, fp), lengths,
                              [outs[q] for q in carried(li)] if li < k else None, wants,
                              shm_streams.step_bytes(max(lengths)))


def reduce_scatter(plan: Plan, seq: int, fp: bytes, out: np.ndarray, ins: Sequence[np.ndarray],
                   uf) -> None:
    """out := the reduction over the group of every rank's ins[rank] (hosts of equal size).

    Within each host, leader i reduces, over its host, the blocks destined for the ranks it
    carries (local index j with j % k == i on every host); ring i then reduce-scatters them
    over TCP, one pass per carried index, which leaves leader i the results of its host's
    carried ranks; it hands them out through shared memory.
    """
    topo = plan.topology
    hosts, li, k = topo.hosts, plan.index, plan.leaders
    n = out.size
    local = plan.local

    def destined(i: int) -> list[int]:
        """The ranks whose blocks leader i reduces, carried index by carried index, host by
        host (the order of its cross-host passes)."""
        return [h[j] for j in _assigned(plan, i) for h in hosts]

    mine = destined(li) if li < k else []
    work = np.empty(n * len(mine), dtype=out.dtype)
    for m, q in enumerate(mine):
        np.copyto(work[m * n:(m + 1) * n], ins[q].reshape(-1))
    if local is not None:
        lengths = [n * len(destined(i)) if i < k else 0 for i in range(local.size)]
        sends = {i: [ins[q].reshape(-1) for q in destined(i)]
                 for i in range(min(k, local.size)) if i != li}
        with local.renumbered():
            shm_streams.reduce_scatter(local.shm, local.shm_barrier(seq, fp), uf, out.dtype,
                                       lengths, sends, [work] if li < k else [])
    results = {}
    if li < k:
        nh = len(hosts)
        with plan.cross.renumbered():
            for m, j in enumerate(_assigned(plan, li)):
                target = out if j == li else np.empty(n, dtype=out.dtype)
                blocks = [work[(m * nh + h) * n:(m * nh + h + 1) * n] for h in range(nh)]
                over_sockets.reduce_scatter(plan.cross, seq, fp, target, blocks, uf)
                results[j] = target
    if local is not None and k < local.size:
        item = out.itemsize
        lengths = [0] * local.size
        for i in range(k):
            lengths[i] = n * item * (len(_assigned(plan, i)) - 1)
        publish = ([results[j].view(np.uint8) for j in _assigned(plan, li) if j != li]
                   if li < k else None)
        wants = {}
        if li >= k:
            leader = li % k
            position = _assigned(plan, leader).index(li) - 1
            wants[leader] = [(position * n * item, out.view(np.uint8))]
        with local.renumbered():
            shm_streams.relay(local.shm, local.shm_barrier(seq, fp), lengths, publish, wants,
                              shm_streams.step_bytes(n * item))
