"""The keys the node agents share in the run's store: who ended each round, the job's restart
count, the exit barrier, goodbyes and the final failure.

Keys (all under `agent/`):
    restarts                  job-wide count of restarts caused by worker failures
    round/<r>/ended           who ended round r and why (compare-and-set: the first one wins)
    round/<r>/failure/<node>  JSON of the worker failure that node saw in round r
    round/<r>/exit, exit_done exit barrier of round r
    bye/<node>                a node left for good (the store's host waits for them)
    gone                      nodes of a finished job that left; the last one deletes the
                              job's keys where the store can (etcd)
    nproc/<node rank>         (in the round's own store) each node's worker count
    final_failure             JSON summary once restarts ran out; then the rendezvous closes

Restarts are counted once per round whichever node saw the failure first: only the node that
wins the round's `ended` key counts one.
"""

from __future__ import annotations

import json
import logging
from typing import Optional, Sequence

from shoal.collectives.store.api import Store
from shoal.collectives.types import StoreError

logger = logging.getLogger(__name__)

RESTARTS = "agent/restarts"
FINAL_FAILURE = "agent/final_failure"
GONE = "agent/gone"


def ended_key(round_: int) -> str:
    """The key whose first writer ended round `round_`."""
    return f"agent/round/{round_}/ended"


def bye_key(node_id: str) -> str:
    """The key a node writes once it left for good."""
    return f"agent/bye/{node_id}"


def claim_round(store: Store, round_: int, why: str, node_id: str,
                record: Optional[dict] = None) -> bool:
    """End round `round_` for `why`; True if this node was first (only then does it count)."""
    mine = f"{why}:{node_id}"
    try:
        if record is not None:
            store.set(f"agent/round/{round_}/failure/{node_id}", json.dumps(record))
        won = store.compare_set(ended_key(round_), "", mine).decode() == mine
    except StoreError as exc:
        logger.warning("Could not record the end of round %s in the store: %s", round_, exc)
        return why == "worker_failure"  # count it: safer to over-count than loop forever
    if not won:
        logger.info("Round %s was already ended by another node; not counting it", round_)
    return won


def restarts_used(store: Store) -> int:
    """How many restarts the job has used so far."""
    return int(store.add(RESTARTS, 0))


def count_restart(store: Store) -> int:
    """Count one more restart; returns the new total."""
    return int(store.add(RESTARTS, 1))


def publish_nproc(round_store: Store, group_rank: int, nproc: int) -> None:
    """Tell the round's other nodes how many workers this node runs."""
    round_store.set(f"agent/nproc/{group_rank}", str(nproc))


def read_nprocs(round_store: Store, num_nodes: int, timeout: float) -> list[int]:
    """Every node's worker count in the round, by node rank (waits up to `timeout`)."""
    return [int(v) for v in round_store.multi_get(
        [f"agent/nproc/{r}" for r in range(num_nodes)], timeout)]


def arrive_at_exit(store: Store, round_: int, num_nodes: int) -> None:
    """This node's workers succeeded in round `round_`; the last node to arrive opens the exit."""
    base = f"agent/round/{round_}"
    if int(store.add(f"{base}/exit", 1)) >= num_nodes:
        store.set(f"{base}/exit_done", "1")


def exit_done_key(round_: int) -> str:
    """The key set once every node of round `round_` arrived at the exit barrier."""
    return f"agent/round/{round_}/exit_done"


def record_final_failure(store: Store, record: dict) -> None:
    """Publish the failure that ended the job (with its summary) for every node to report."""
    store.set(FINAL_FAILURE, json.dumps(record))


def read_final_failure(store: Store, timeout: float) -> Optional[tuple[str, Optional[dict]]]:
    """The job's final failure as (summary, record), or None when none was published.

    Raises:
        StoreError: the store did not answer.
    """
    raw = store.get(FINAL_FAILURE, timeout)
    if not raw:
        return None
    try:
        failure = json.loads(raw)
        return failure["summary"], failure
    except (ValueError, KeyError, TypeError):
        return "shoal run: the job failed on another node (its summary is unreadable).", None


def goodbye_keys(participants: Sequence[str], node_id: str) -> list[str]:
    """The goodbye keys of every participant but `node_id`."""
    return [bye_key(p) for p in participants if p != node_id]
