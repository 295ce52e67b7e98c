"""What the agent hands its workers and users: the worker environment, the worker command
line, node ids, and the failure summary.

A worker's environment is built here and nowhere else: `node_env` is what every worker of a
node starts from (the launcher's environment and its flags), `worker_env` adds one worker's
place in the round (docs/design.md, "Environment of a worker").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from typing import Collection, Mapping, Optional, Sequence

from shoal.collectives import settings as collectives_settings
from shoal.core import settings as core_settings
from shoal.elastic.errors import ERROR_FILE_ENV

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerPlace:
    """Where one worker sits in a round."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    num_nodes: int
    round: int


def node_env(environ: Mapping[str, str], *, nproc_per_node: int,
             collective_timeout: Optional[float] = None, profile_dir: Optional[str] = None,
             agent_only: Collection[str] = ()) -> dict[str, str]:
    """The environment every worker of this node starts from: the launcher's `environ` without
    what belongs to the agent alone (`agent_only`, and its own TORCHELASTIC_ERROR_FILE: each
    worker gets one of its own), plus what the launcher's flags ask of every worker."""
    env = {k: v for k, v in environ.items() if k not in agent_only and k != ERROR_FILE_ENV}
    if collective_timeout is not None:
        # init_process_group reads it as its default timeout (collectives.env).
        env[collectives_settings.COLLECTIVE_TIMEOUT.name] = repr(collective_timeout)
    if "OMP_NUM_THREADS" not in environ and nproc_per_node > 1:
        # torchrun's rule: several workers per node and no OMP_NUM_THREADS -> 1 per worker.
        env["OMP_NUM_THREADS"] = "1"
        logger.warning("Setting OMP_NUM_THREADS=1 for each of the %d workers on this node, so "
                       "they do not overload it; set OMP_NUM_THREADS yourself to tune it",
                       nproc_per_node)
    if profile_dir:  # every worker's job profiler (core.profiler.job)
        env[core_settings.PROFILE_DIR.name] = os.path.abspath(profile_dir)
    return env


def worker_env(base: Mapping[str, str], place: WorkerPlace, *, master_addr: str,
               master_port: int, run_id: str, restarts: int, max_restarts: int,
               checkpoint_dir: str, auth_token: str, multiproc_dir: Optional[str],
               dump_dir: Optional[str] = None, role: str = "default",
               error_file: Optional[str] = None) -> dict[str, str]:
    """`base` plus torchrun's variables and shoal's for the worker at `place`."""
    env = dict(base)
    env.update({
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.group_rank),
        "GROUP_WORLD_SIZE": str(place.num_nodes),
        "ROLE_RANK": str(place.rank),
        "ROLE_WORLD_SIZE": str(place.world_size),
        "ROLE_NAME": role,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        core_settings.RUN_ID.name: run_id,
        core_settings.RESTART_COUNT.name: str(restarts),
        core_settings.RDZV_ROUND.name: str(place.round),
        core_settings.CHECKPOINT_DIR.name: checkpoint_dir,
        core_settings.AUTH_TOKEN.name: auth_token,
        collectives_settings.ASYNC_ERROR_HANDLING.name: "1",
        # The agent hosts the workers' store: every rank connects as a client.
        collectives_settings.USE_AGENT_STORE.name: "1",
        # torchrun's names, so scripts written for torchrun run unchanged.
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PYTHONUNBUFFERED": "1",
    })
    if multiproc_dir:
        env["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
    if dump_dir:
        # Watchdog dumps go where the agent looks for them (to blame a hung rank).
        env[collectives_settings.DUMP_DIR.name] = dump_dir
    if error_file:
        env[ERROR_FILE_ENV] = error_file
    return env


def default_node_id(node_rank: Optional[int] = None) -> str:
    """A unique node id; with a node rank, ids sort (and so get group ranks) in that order."""
    base = f"{socket.gethostname()}-{os.getpid()}"
    return base if node_rank is None else f"n{node_rank:05d}-{base}"


def python_argv(script: str, args: Sequence[str], module: bool = False) -> tuple[str, ...]:
    """The worker command line: this interpreter running `script` (or `-m module`)."""
    head = [sys.executable, "-u"]
    return tuple(head + (["-m", script] if module else [script]) + list(args))


def summary_text(run_id: str, failure: Mapping, restarts: int, max_restarts: int) -> str:
    """The failure summary printed when restarts run out: rank, exit and last log lines."""
    worker = (f"rank {failure['rank']} (local rank {failure['local_rank']} on node "
              f"{failure['node']}, pid {failure['pid']})")
    lines = [
        f"shoal run: job {run_id!r} failed after {restarts} restart(s) "
        f"(--max-restarts {max_restarts}).",
    ]
    whose = "its log"
    if failure.get("hang"):
        # The worker that exited only noticed; the record names the one that hung.
        lines.append(f"The failing worker: {worker} hung in round {failure['round']}: "
                     f"{failure['hang']}")
        whose = f"the log of rank {failure['detected_by']}, which noticed"
    else:
        lines.append(f"The failing worker: {worker} ended with {failure['exit']} in round "
                     f"{failure['round']}.")
    if failure.get("error"):
        lines.append(f"Its error: {failure['error']}")
    if failure.get("error_file"):
        lines.append(f"Error file: {failure['error_file']}")
    if failure.get("dump_path"):
        lines.append(f"Watchdog dump: {failure['dump_path']}")
    where = f" ({failure['log_path']})" if failure.get("log_path") else ""
    if failure.get("tail"):
        lines.append(f"Last lines of {whose}{where}:")
        lines.extend(f"    {line}" for line in failure["tail"])
    else:
        lines.append(f"It wrote no output{where}.")
    return "\n".join(lines)
