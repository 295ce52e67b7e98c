"""Which job of a run a node belongs to, and the run's store keys scoped to it.

A run id can be used by one job after another: each job is a generation of the rendezvous
state (`RendezvousState.generation`), and its keys in the run's store live under it (`job/<g>/`
for the agents' keys, `rdzv/<run>/<g>/round_<r>/` for each round's), so a new job never sees
an earlier one's restart count or rounds.

When the stored state disappears mid-job (an etcd lease lost or revoked, the store wiped), the
node that writes it again must keep the job's generation, or the job would start over with its
restart budget reset (issue 34). A node that joined a round knows the generation; so does a
node that read the job's open state while waiting to join it (a round was full, or running).
Only a node that never saw the job's open state starts a new generation.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Callable, Optional

from shoal.collectives.store.api import Store
from shoal.elastic.rendezvous.sealing import ForgedValueError, Seal, SignedStore
from shoal.elastic.rendezvous.state import RendezvousState

logger = logging.getLogger(__name__)

__all__ = ["JobScope"]


class JobScope:
    """One node's job of a run: its generation, and the store scoped to it.

    Args:
        store: the run's key-value store.
        run_id: the run's id.
        seal: the job's MAC (every value read back is checked under it).
        on_forged: called with the error when a value read back fails its MAC.
    """

    def __init__(self, store: Store, run_id: str, seal: Seal,
                 on_forged: Callable[[ForgedValueError], None]):
        self._store = store
        self._run_id = run_id
        self._seal = seal
        self._on_forged = on_forged
        # Written by the joining thread only; the heartbeat thread reads it for a fresh state.
        self.generation: Optional[str] = None

    def store(self) -> Store:
        """The run's store scoped to this job (the whole store before the node knows it)."""
        if not self.generation:
            return self._store
        return self._signed(f"job/{self.generation}")

    def round_store(self, state: RendezvousState) -> SignedStore:
        """The store of round `state.round` of this job."""
        run = f"rdzv/{self._run_id}"
        if state.generation:
            run += f"/{state.generation}"
        return self._signed(f"{run}/round_{state.round}")

    def release(self, node_id: str) -> int:
        """Delete this job's keys where the store can delete by prefix (etcd); how many went."""
        delete = getattr(self._store, "delete_prefix", None)
        if delete is None or not self.generation:
            return 0
        gone = 0
        for prefix in (f"job/{self.generation}/", f"rdzv/{self._run_id}/{self.generation}/"):
            gone += int(delete(prefix))
        logger.info("Node %s removed the %d store keys of finished run %s", node_id, gone,
                    self._run_id)
        return gone

    def fresh_state(self, last_round: Optional[int], seen: Optional[RendezvousState],
                    reason: str) -> RendezvousState:
        """The state to write when none is stored.

        `last_round` is the round this node ran (None before its first), `seen` the last
        state it read. A node of the job (it ran a round, or read the job's open state while
        waiting to join) writes the round after the newest it knows, under the job's
        generation, so every node sees its round as over and the job keeps its restart count;
        any other node starts a new job: round 0 of a new generation.
        """
        generation = self.generation
        rounds = [r for r in (last_round, seen.round if seen is not None else None)
                  if r is not None]
        if last_round is None and seen is not None and not seen.closed:
            generation = generation or seen.generation
        elif last_round is None:
            generation, rounds = None, []
        if not rounds:
            return RendezvousState(opened_at=time.time(),
                                   generation=generation or secrets.token_hex(8))
        return RendezvousState(round=max(rounds) + 1, opened_at=time.time(), reason=reason,
                               generation=generation or "")

    def _signed(self, prefix: str) -> SignedStore:
        return SignedStore(self._store, prefix, self._seal, on_forged=self._on_forged)
