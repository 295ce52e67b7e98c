"""What the agent hands its workers and users: the worker environment, the worker command
line, node ids, and the failure summary."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from typing import Mapping, Optional, Sequence


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


def worker_env(base: Mapping[str, str], place: WorkerPlace, *, master_addr: str,
               master_port: int, run_id: str, restarts: int, max_restarts: int,
               checkpoint_dir: str, auth_token: str,
               multiproc_dir: Optional[str], dump_dir: Optional[str] = None) -> dict[str, str]:
    """`base` plus torchrun's variables and shoal's (DESIGN.md, "Environment of a worker")."""
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
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "SHOAL_RUN_ID": run_id,
        "SHOAL_RESTART_COUNT": str(restarts),
        "SHOAL_RDZV_ROUND": str(place.round),
        "SHOAL_CHECKPOINT_DIR": checkpoint_dir,
        "SHOAL_AUTH_TOKEN": auth_token,
        "SHOAL_ASYNC_ERROR_HANDLING": "1",
        # The agent hosts the workers' store: every rank connects as a client.
        "SHOAL_USE_AGENT_STORE": "1",
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
        env["SHOAL_DUMP_DIR"] = dump_dir
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
