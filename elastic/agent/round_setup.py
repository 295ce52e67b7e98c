"""One round's setup on a node: the workers' master store, their global ranks, environments,
error files and log files."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Optional, Sequence

from shoal.elastic.agent.env import WorkerPlace, worker_env
from shoal.elastic.agent.store_door import RESTART_SNIFF_S, SNIFF_S, WorkerStoreDoor
from shoal.elastic.agent.spec import WorkerSpec
from shoal.elastic.api import RendezvousInfo

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """This node's workers in one round: their global ranks and environments, which node runs
    each global rank, and each local worker's error file."""

    ranks: list[int]
    envs: list[dict[str, str]]
    world_size: int
    restarts: int
    rank_nodes: dict[int, str]
    error_files: dict[int, str]


def open_master_store(spec: WorkerSpec, sniff_s: float = SNIFF_S) -> WorkerStoreDoor:
    """The workers' store, hosted by node rank 0's agent: shoal's authenticated store and
    torch's protocol on one port (see store_door); a fresh one per round, so restarted workers
    never see the dead attempt's keys."""
    return WorkerStoreDoor(spec.local_addr, spec.auth_token, sniff_s)


def next_sniff(met_torch: bool, relayed: int, current: float) -> float:
    """The sniff window of the next round's door, from what this round's door met (a torch
    client; `relayed` shoal clients): a job whose workers were all shoal clients restarts the
    same script (RESTART_SNIFF_S), one that met a torch client keeps SNIFF_S, and a door that
    met nobody teaches nothing."""
    if met_torch:
        return SNIFF_S
    return RESTART_SNIFF_S if relayed else current


def plan_round(spec: WorkerSpec, info: RendezvousInfo, counts: Sequence[int], *,
               master_addr: str, master_port: int, restarts: int,
               dump_dir: Optional[str]) -> RoundPlan:
    """Place this node's workers in the round, given every node's worker count (`counts`, by
    node rank): ranks are numbered node by node."""
    nproc = spec.nproc_per_node
    first = sum(counts[: info.group_rank])
    world = sum(counts)
    rank_nodes: dict[int, str] = {}
    for node_rank, count in enumerate(counts):
        start = sum(counts[:node_rank])
        for rank in range(start, start + count):
            rank_nodes[rank] = info.participants[node_rank]
    ranks = [first + i for i in range(nproc)]
    error_files = {rank: path for rank in ranks
                   if (path := fresh_error_file(spec, info.round, rank)) is not None}
    envs = [
        worker_env(spec.base_env, WorkerPlace(rank, local, world, nproc, info.group_rank,
                                              info.num_nodes, info.round),
                   master_addr=master_addr, master_port=master_port, run_id=spec.run_id,
                   restarts=restarts, max_restarts=spec.max_restarts,
                   checkpoint_dir=spec.checkpoint_dir, auth_token=spec.auth_token,
                   multiproc_dir=spec.multiproc_dir, dump_dir=dump_dir, role=spec.role,
                   error_file=error_files.get(rank))
        for local, rank in enumerate(ranks)
    ]
    return RoundPlan(ranks, envs, world, restarts, rank_nodes, error_files)


def fresh_error_file(spec: WorkerSpec, round_: int, rank: int) -> Optional[str]:
    """Where rank `rank` writes its TORCHELASTIC_ERROR_FILE in round `round_` (None without an
    error directory). Its folder is created here: torch's `@record` writes the file but makes
    no folder, and would fail with FileNotFoundError, losing the root cause. A file left there
    by an earlier job is removed, so it is never taken for this worker's."""
    if spec.error_dir is None:
        return None
    path = os.path.join(spec.error_dir, spec.run_id, f"round_{round_}", f"rank_{rank}",
                        "error.json")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as exc:
        logger.warning("Rank %d gets no TORCHELASTIC_ERROR_FILE in round %d: cannot create %s "
                       "(%s)", rank, round_, os.path.dirname(path), exc)
        return None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return path


def log_path(spec: WorkerSpec, round_: int, rank: int) -> Optional[str]:
    """Where rank `rank`'s output goes in round `round_` (None without a log directory)."""
    if spec.log_dir is None:
        return None
    return os.path.join(spec.log_dir, spec.run_id, f"round_{round_}", f"rank_{rank}.log")
