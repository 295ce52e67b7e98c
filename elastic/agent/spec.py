"""What the node agent is asked to run (`WorkerSpec`), how it ended (`AgentResult`), and the
bounds it keeps while finishing."""

from __future__ import annotations

import dataclasses
import signal
from typing import Mapping, Optional

from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE
from shoal.elastic.agent.logs import StreamRoute

DEFAULT_EXIT_BARRIER_TIMEOUT_S = 300.0
DEFAULT_MASTER_TIMEOUT_S = 60.0
# The exit statuses a worker ends with when a *peer* failed (its collective watchdog aborted):
# such a failure is a consequence, so the agent waits briefly for the node that caused it.
PEER_FAILURE_EXIT_CODES = frozenset({ASYNC_ERROR_EXIT_CODE})
# Once the job is over (or the agent was told to stop), each rendezvous/store call may take this
# long at most, and finishing (closing the rendezvous, goodbyes, leaving) this long in all: a
# dead etcd must not hold a finished agent for minutes (its calls would wait 30 s each).
EXIT_CALL_TIMEOUT_S = 3.0
EXIT_BUDGET_S = 8.0
# After SIGTERM/SIGINT the workers get the grace period; the agent then has this long to leave
# the rendezvous before it exits regardless (Kubernetes sends SIGKILL after its own grace).
SIGNAL_LEAVE_S = 2.5


class AgentInterrupted(Exception):
    """SIGTERM or SIGINT reached the agent; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(f"The agent received {signal.Signals(signum).name}.")
        self.signum = signum


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What to run on this node and how."""

    argv: tuple[str, ...]                # the worker's command line (python, script, args)
    nproc_per_node: int
    run_id: str
    checkpoint_dir: str
    auth_token: str
    local_addr: str                      # where other nodes reach this node's master store
    max_restarts: int
    monitor_interval: float = 0.1
    grace_period: float = 5.0
    log_dir: Optional[str] = None
    tee: bool = False
    multiproc_dir: Optional[str] = None  # PROMETHEUS_MULTIPROC_DIR for the workers
    # The environment every worker starts from (`env.node_env` builds the launcher's).
    base_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT_S
    master_timeout: float = DEFAULT_MASTER_TIMEOUT_S
    # Signals forwarded to the workers before they are stopped (torchrun's default set).
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    # Per local rank, where stdout and stderr go (None: console, plus files with log_dir).
    routes: Optional[tuple[StreamRoute, ...]] = None
    role: str = "default"
    # Where each worker's TORCHELASTIC_ERROR_FILE lives: ERROR_DIR/RUN_ID/round_N/rank_R/.
    error_dir: Optional[str] = None
    # Where the workers' watchdogs write their dumps (None: SHOAL_DUMP_DIR of base_env, else
    # the temporary directory); the agent reads them to blame a hung rank.
    dump_dir: Optional[str] = None

    def __post_init__(self):
        if not self.argv:
            raise ValueError("WorkerSpec.argv must name a program to run.")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}.")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}.")
        if not self.monitor_interval > 0:
            raise ValueError(f"monitor_interval must be > 0 seconds, got {self.monitor_interval}.")


@dataclasses.dataclass(frozen=True)
class AgentResult:
    """How the agent ended: its exit status, and the failure summary when it failed."""

    exit_code: int
    summary: Optional[str] = None
    rounds: int = 0
    # The failure record of the worker that ended the job (its rank, node, exit, error).
    failure: Optional[dict] = None
