"""What a tcp collective runs on (`Links`), and the internal errors its algorithms raise.

A group's `Links` cover all its ranks. The hierarchical algorithms also run on `Links.subset`s
of them: the ranks of one host (with their shared memory) and the ranks that carry one share
of the traffic between hosts. A subset reuses the group's sockets, renumbered 0..n-1 in the
order given, so every algorithm runs on it unchanged; `renumbered` maps the peers named in the
errors they raise back to group ranks.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional, Sequence

from shoal.collectives.backends.tcp import algorithms as algos
from shoal.collectives.backends.tcp import shm
from shoal.collectives.backends.tcp.framing import Tampered
from shoal.collectives.backends.tcp.mesh import Mesh
from shoal.collectives.backends.tcp.pump import LinkDown, SenderThread
from shoal.collectives.backends.tcp.reasons import FailureReason
from shoal.collectives.types import CollectiveMismatch

__all__ = ["Links", "GroupFailed", "P2PMismatch"]


class P2PMismatch(CollectiveMismatch):
    """A received point-to-point message does not fit the receiving array (the group survives)."""


class GroupFailed(Exception):
    """Raised inside an operation that found the group failed (internal).

    `reason` is the failure it decided on, or None when the group had failed already.
    """

    def __init__(self, reason: Optional[FailureReason] = None):
        super().__init__(reason.cause if reason is not None else "the group failed")
        self.reason = reason


class Links:
    """What a tcp collective runs on: this rank's place in the group, its connections to every
    peer (`tx`/`rx` data connections indexed by rank, `framing.Outbound`/`Inbound`, `mesh` and its `control` channel, the
    small-message `direct` path), the shared-memory slots when every rank is on this host, the
    two-level plan when the ranks span hosts (`hier`), and reusable scratch space and sender
    thread."""

    def __init__(self, rank: int, size: int, mesh: Mesh, direct: algos.Direct,
                 shared: Optional[shm.SharedSlots], name: str, failed: Callable[[], bool],
                 tx: Optional[list] = None, rx: Optional[list] = None,
                 members: Optional[Sequence[int]] = None):
        self.rank = rank
        self.size = size
        self.mesh = mesh
        self.control = mesh.control  # the point-to-point messages' channel
        self.tx = mesh.tx if tx is None else tx
        self.rx = mesh.rx if rx is None else rx
        self.direct = direct
        # The point-to-point receives' own poll policy (`spin`): its count of late answers is
        # apart from the collectives', whose peers answer on another rhythm.
        self.p2p_spin = direct.spin.child()
        self.shm = shared
        self.hier = None  # a `hierarchical.Plan` when the group spans hosts (set by the group)
        self.failed = failed  # True once the group failed (a p2p receive stops waiting then)
        # Group rank of each rank of these links (a subset's renumbering), or None: identity.
        self.members = None if members is None else tuple(members)
        self._name = name
        self.name = name
        self._scratch: Optional[bytearray] = None
        self._sender: Optional[SenderThread] = None
        self._subsets: list[Links] = []

    def subset(self, members: Sequence[int], shared: Optional[shm.SharedSlots] = None,
               label: str = "sub") -> "Links":
        """Links among `members` (group ranks, this rank among them), renumbered in that order."""
        sub_rank = members.index(self.rank)
        tx = [self.tx[m] for m in members]
        rx = [self.rx[m] for m in members]
        direct = algos.Direct(sub_rank, len(members), tx, rx, self.direct.spin.child())
        links = Links(sub_rank, len(members), self.mesh, direct, shared,
                      f"{self._name}-{label}", self.failed, tx, rx, members)
        self._subsets.append(links)
        return links

    @contextlib.contextmanager
    def renumbered(self):
        """Errors raised inside name peers by their rank in these links; this maps them back
        to the group's ranks."""
        try:
            yield
        except (LinkDown, Tampered, algos.HeaderMismatch, algos.ProtocolError) as exc:
            if self.members is not None and 0 <= exc.peer < len(self.members):
                exc.peer = self.members[exc.peer]
            raise

    def scratch(self, nbytes: int) -> memoryview:
        """A reusable buffer of `nbytes` (operations run one at a time)."""
        buf = self._scratch
        if buf is None or len(buf) < nbytes:
            buf = self._scratch = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def reaches_another_host(self, peers: Sequence[int]) -> bool:
        """Whether any of these peers (ranks of these links) is on another host, as the mesh
        decided when it made their links (`Mesh.remote`)."""
        group = self.members
        return any(self.mesh.remote[p if group is None else group[p]] for p in peers)

    def sender_thread(self) -> SenderThread:
        """The sender thread of the largest ring all_reduces, started on first use."""
        if self._sender is None:
            self._sender = SenderThread(f"shoal-pg-{self._name}-sender")
        return self._sender

    def shm_barrier(self, seq: int, fp: bytes) -> Callable[[], object]:
        """A barrier for the shared-memory algorithms: an empty exchange of this op's header
        with every peer, so each step still checks the sequence number and fingerprint."""
        return functools.partial(self.direct.exchange, seq, fp, b"")

    def close(self) -> None:
        """Stop the sender threads and drop the shared memory (its mappings go with the last
        array that views them: a collective aborted in another thread may still be reading)."""
        if self._sender is not None:
            self._sender.stop()
        for sub in self._subsets:
            sub.close()
        if self.hier is not None:
            self.hier.close()
        self.shm = None
        self.hier = None
