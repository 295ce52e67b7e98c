"""The node agent: one per node, it runs this node's workers through rendezvous rounds.

Each round: join the rendezvous, host (node rank 0) or look up the workers' TCPStore, start the
local workers with torchrun's environment, and watch them. A worker failure stops this node's
workers and ends the round for every node at once (through the rendezvous, not a collective
timeout); then everyone meets again and restarts from the last checkpoint. Restarts are
counted for the whole job in the run's store, once per round whichever node saw the failure
first. A lost node or a waiting one ends the round too, without costing a restart.

Keys the agents share in the run's store (all under `agent/`):
    restarts                  job-wide count of restarts caused by worker failures
    round/<r>/ended           who ended round r and why (compare-and-set: the first one wins)
    round/<r>/failure         JSON of the worker failure that ended round r
    round/<r>/exit, exit_done exit barrier of round r
    bye/<node>                a node left for good (the store's host waits for them)
    gone                      nodes of a finished job that left; the last one deletes the
                              job's keys where the store can (etcd)
    nproc/<node rank>         (in the round's own store) each node's worker count
    final_failure             JSON summary once restarts ran out; then the rendezvous closes
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import tempfile
import threading
import time
from typing import Callable, Mapping, Optional

from shoal.collectives import api as _collectives_api
from shoal.collectives.types import StoreError, StoreTimeout
from shoal.elastic import metrics
from shoal.elastic.errors import (
    ERROR_FILE_ENV,
    error_document,
    read_error_file,
    write_error_file,
)
from shoal.elastic.agent.env import (
    WorkerPlace,
    default_node_id,
    python_argv,
    summary_text,
    worker_env,
)
from shoal.elastic.agent.logs import StreamRoute
from shoal.elastic.agent.workers import WorkerExit, WorkerGroup, describe_exit
from shoal.elastic.agent.hang_blame import Hang, find_hang
from shoal.elastic.agent.round_poll import RoundPoller
from shoal.elastic.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousTimeoutError,
    StoreHostLostError,
)

logger = logging.getLogger(__name__)

__all__ = ["Agent", "AgentInterrupted", "AgentResult", "WorkerSpec", "default_node_id",
           "python_argv"]

DEFAULT_EXIT_BARRIER_TIMEOUT_S = 300.0
DEFAULT_MASTER_TIMEOUT_S = 60.0
# The exit statuses a worker ends with when a *peer* failed (its collective watchdog aborted):
# such a failure is a consequence, so the agent waits briefly for the node that caused it.
PEER_FAILURE_EXIT_CODES = frozenset({getattr(_collectives_api, "ASYNC_ERROR_EXIT_CODE", 75)})
_STORE_ACK_TIMEOUT_S = 5.0
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


class Agent:
    """Run this node's workers until the job succeeds, fails for good, or is interrupted.

    Args:
        spec: the workers and the restart policy.
        handler: this node's `RendezvousHandler` (its `store` is the run's store).
        is_store_host: this process hosts the run's store (the embedded TCPStore); it then
            waits for the other nodes to leave the exit barrier before returning.
    """

    def __init__(self, spec: WorkerSpec, handler, *, is_store_host: bool = False,
                 console_out=None, console_err=None):
        self.spec = spec
        self.handler = handler
        self.node_id = handler.node_id
        self._is_store_host = is_store_host
        self._console_out = console_out
        self._console_err = console_err
        self._group: Optional[WorkerGroup] = None
        self._master_store = None
        self._signum: Optional[int] = None
        self._wake = threading.Event()
        self._rounds = 0
        self._last_info: Optional[RendezvousInfo] = None
        self._host_lost: Optional[StoreHostLostError] = None
        # True while the main thread runs rounds: a signal then raises AgentInterrupted at once
        # (ending any blocking rendezvous or store call), except inside _critical() sections.
        self._interruptible = False
        self._killable: Optional[WorkerGroup] = None  # for the last-resort exit after a signal
        # Where the workers' watchdogs write their dumps (read to blame a hung rank), and which
        # node runs each global rank in the current round.
        self._dump_dir = spec.base_env.get("SHOAL_DUMP_DIR") or tempfile.gettempdir()
        self._rank_nodes: dict[int, str] = {}
        self._error_files: dict[int, str] = {}  # global rank -> its TORCHELASTIC_ERROR_FILE
        metrics.set_run_id(spec.run_id)
        metrics.set_dump_dir(self._dump_dir)

    @property
    def store(self):
        """The job's keys: the run's store scoped to the job the rendezvous joined (a new job
        under a used run id starts clean), or the whole store for handlers without scoping."""
        scoped = getattr(self.handler, "job_store", None)
        return scoped if scoped is not None else self.handler.store

    def store_host_lost(self, error: StoreHostLostError) -> None:
        """The run's store is gone with its host (see elastic.store_host): end this agent.

        Called from the watch's thread; the main loop notices at once and stops the workers.
        """
        self._host_lost = error
        group = self._group
        if group is not None:
            group.changed.set()
        self._wake.set()

    def _host_lost_result(self) -> AgentResult:
        self._stop_workers("the store host is gone")
        return AgentResult(1, f"shoal run: {self._host_lost}", self._rounds)

    # ------------------------------------------------------------------ signals

    def install_signal_handlers(self) -> Callable[[], None]:
        """Forward the spec's signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default) to the
        workers and end the agent; returns a restorer."""
        previous = {s: signal.signal(s, self._on_signal) for s in self.spec.signals}

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return restore

    def _on_signal(self, signum, frame) -> None:
        first = self._signum is None
        self._signum = signum
        group = self._group
        if group is not None:
            group.send_signal(signum)
            group.changed.set()
        self._wake.set()
        if first:
            logger.warning("Received %s: forwarding it to the workers (grace period %gs)",
                           signal.Signals(signum).name, self.spec.grace_period)
            leave_by = time.monotonic() + self.spec.grace_period + SIGNAL_LEAVE_S
            self._limit_backend(leave_by)
            self._arm_last_resort(signum, leave_by + 1.0)
        if self._interruptible:
            # Break out of whatever blocking rendezvous or store call the main thread is in.
            raise AgentInterrupted(signum)

    @contextlib.contextmanager
    def _critical(self):
        """A section a signal must not cut short (starting or stopping workers); a signal that
        came meanwhile is raised at its end."""
        before, self._interruptible = self._interruptible, False
        try:
            yield
        finally:
            self._interruptible = before
        if before and self._signum is not None:
            raise AgentInterrupted(self._signum)

    def _arm_last_resort(self, signum: int, at: float) -> None:
        """If the agent is still alive at `at` (time.monotonic()) after a signal, something it
        waits on ignores every bound: kill the workers and exit, as Kubernetes would."""
        def expire() -> None:
            time.sleep(max(0.0, at - time.monotonic()))
            logger.error("The agent did not finish within %.1fs of %s; killing its workers and "
                         "exiting now", self.spec.grace_period + SIGNAL_LEAVE_S + 1.0,
                         signal.Signals(signum).name)
            group = self._killable
            if group is not None:
                group.send_signal(signal.SIGKILL)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(128 + signum)

        threading.Thread(target=expire, name="shoal-agent-last-resort", daemon=True).start()

    def _limit_backend(self, until: Optional[float] = None) -> None:
        """Bound every rendezvous/store call from now on (see EXIT_CALL_TIMEOUT_S)."""
        limit = getattr(self.handler, "limit", None)
        if limit is not None:
            limit(EXIT_CALL_TIMEOUT_S, until)

    # ------------------------------------------------------------------ main loop

    def run(self) -> AgentResult:
        """Run rounds until done; never raises for worker failures (see the exit code).

        On return the agent has left the rendezvous (`handler.shutdown()`); closing the
        handler's backend and store is the caller's job, after this returns.
        """
        try:
            self._interruptible = True
            try:
                result = self._run()
            finally:
                self._interruptible = False
        except AgentInterrupted as exc:
            result = self._interrupted(exc.signum)
        finally:
            self._stop_workers("the agent is exiting")
            self._close_master_store()
        self._limit_backend(time.monotonic() + EXIT_BUDGET_S)
        self._leave(result)
        return result

    def _leave(self, result: AgentResult) -> None:
        """Leave the rendezvous; when the job is over, the store's host waits for the others.

        Each node writes `agent/bye/<node>` only after its own `shutdown()`, so the host (whose
        process serves the store) stops serving only once nobody needs the store any more.
        """
        try:
            self.handler.shutdown()
        except Exception as exc:  # noqa: BLE001  (leaving must not mask the job's outcome)
            logger.warning("Leaving the rendezvous failed: %s", exc)
        info = self._last_info
        if info is None or result.exit_code >= 128 or self._host_lost is not None:
            return
        if not self._is_store_host:
            self._safe(lambda: self.store.set(f"agent/bye/{self.node_id}", "1"))
            if result.exit_code == 0:
                # The last node out of a finished job drops its keys (etcd keeps them
                # otherwise); a failed job keeps them for diagnosis and for late joiners.
                gone = self._safe(lambda: int(self.store.add("agent/gone", 1)), 0)
                if gone >= info.num_nodes:
                    release = getattr(self.handler, "release_job_keys", None)
                    if release is not None:
                        self._safe(release)
            return
        others = [f"agent/bye/{p}" for p in info.participants if p != self.node_id]
        if others:
            try:
                self.store.wait(others, _STORE_ACK_TIMEOUT_S)
            except StoreError:
                logger.warning("Not every node said goodbye within %gs; stopping the store "
                               "anyway", _STORE_ACK_TIMEOUT_S)

    def _run(self) -> AgentResult:
        while True:
            if self._signum is not None:
                return self._interrupted(self._signum)
            if self._host_lost is not None:
                return self._host_lost_result()
            try:
                info = self._rendezvous()
            except StoreHostLostError as exc:
                self._host_lost = self._host_lost or exc
                return self._host_lost_result()
            except RendezvousClosedError:
                return self._closed_result()
            except RendezvousTimeoutError as exc:
                logger.error("%s", exc)
                return AgentResult(1, f"shoal run: {exc}", self._rounds)
            except RendezvousError as exc:
                logger.error("The rendezvous failed: %s", exc)
                return AgentResult(1, f"shoal run: the rendezvous failed: {exc}", self._rounds)
            try:
                outcome = self._run_round(info)
            except (StoreError, RendezvousError) as exc:
                if self._host_lost is not None or isinstance(exc, StoreHostLostError):
                    self._host_lost = self._host_lost or exc
                    return self._host_lost_result()
                # The store or rendezvous failed mid-round (its host died, etcd is away for
                # longer than the retries): stop here and meet again; the rendezvous retries
                # up to its own timeout and ends the agent if the backend stays away.
                logger.error("Round %s lost the rendezvous or its store (%s); stopping the "
                             "workers and meeting again", info.round, exc)
                self._stop_workers(f"round {info.round} lost its store")
                outcome = "peer_request"
            if isinstance(outcome, AgentResult):
                return outcome
            metrics.note_restart(outcome)

    def _rendezvous(self) -> RendezvousInfo:
        # Only _run calls this, while _interruptible holds: a signal ends the join at once.
        started = time.monotonic()
        if self._signum is not None:
            raise AgentInterrupted(self._signum)
        info = self.handler.next_rendezvous()
        metrics.observe_rendezvous(time.monotonic() - started, info.round)
        self._rounds += 1
        self._last_info = info
        return info

    def _run_round(self, info: RendezvousInfo):
        """Start and watch one round's workers; return a restart reason or a final result."""
        try:
            envs, ranks, restarts = self._prepare(info)
        except (StoreError, RendezvousError) as exc:
            if self.handler.is_closed():
                return self._closed_result()
            logger.warning("Round %s could not start (%s); meeting again", info.round, exc)
            self._signal_restart(f"node {self.node_id} could not start round {info.round}: {exc}")
            return "peer_request"
        argv = list(self.spec.argv)
        log_paths = [self._log_path(info.round, rank) for rank in ranks]
        self._group = WorkerGroup(
            argv, envs, ranks, log_paths=log_paths,
            to_console=self.spec.tee or self.spec.log_dir is None,
            multiproc_dir=self.spec.multiproc_dir, console_out=self._console_out,
            console_err=self._console_err, routes=self.spec.routes,
        )
        logger.info("Round %s: node rank %d of %d runs ranks %s of %d (restart %d)",
                    info.round, info.group_rank, info.num_nodes, ranks,
                    int(envs[0]["WORLD_SIZE"]), restarts)
        self._killable = self._group
        with self._critical():
            self._group.start()
        return self._monitor(info, restarts)

    # ------------------------------------------------------------------ round setup

    def _prepare(self, info: RendezvousInfo) -> tuple[list[dict], list[int], int]:
        """Agree on the master store, every node's worker count, and the restart count."""
        nproc = self.spec.nproc_per_node
        info.store.set(f"agent/nproc/{info.group_rank}", str(nproc))
        if info.group_rank == 0:
            self._close_master_store()
            from shoal.collectives.store.tcp import TCPStore

            # A fresh store per round: restarted workers never see the dead attempt's keys.
            self._master_store = TCPStore(
                self.spec.local_addr, 0, is_master=True, timeout=self.spec.master_timeout,
                token=self.spec.auth_token,
            )
            info.publish_master(self.spec.local_addr, self._master_store.port)
            master_addr, master_port = self.spec.local_addr, self._master_store.port
        else:
            master_addr, master_port = info.read_master(self.spec.master_timeout)
        counts = [int(v) for v in info.store.multi_get(
            [f"agent/nproc/{r}" for r in range(info.num_nodes)], self.spec.master_timeout)]
        first = sum(counts[: info.group_rank])
        world = sum(counts)
        self._rank_nodes = {}
        for node_rank, count in enumerate(counts):
            start = sum(counts[:node_rank])
            for rank in range(start, start + count):
                self._rank_nodes[rank] = info.participants[node_rank]
        restarts = int(self.store.add("agent/restarts", 0))
        metrics.set_job(self.spec.run_id, world, info.num_nodes, self.spec.max_restarts, restarts)
        ranks = [first + i for i in range(nproc)]
        s = self.spec
        envs = [
            worker_env(s.base_env, WorkerPlace(rank, local, world, nproc, info.group_rank,
                                               info.num_nodes, info.round),
                       master_addr=master_addr, master_port=master_port, run_id=s.run_id,
                       restarts=restarts, max_restarts=s.max_restarts,
                       checkpoint_dir=s.checkpoint_dir, auth_token=s.auth_token,
                       multiproc_dir=s.multiproc_dir, dump_dir=self._dump_dir)
            for local, rank in enumerate(ranks)
        ]
        self._error_files = {}
        for env, rank in zip(envs, ranks):
            env["ROLE_NAME"] = s.role
            if s.error_dir is not None:
                path = os.path.join(s.error_dir, s.run_id, f"round_{info.round}",
                                    f"rank_{rank}", "error.json")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a file from an earlier job must not be taken for ours
                env[ERROR_FILE_ENV] = path
                self._error_files[rank] = path
        return envs, ranks, restarts

    def _error_file_of(self, failure: WorkerExit) -> dict:
        """The failure record's error fields: the worker's own error file (torch's @record,
        shoal.elastic.errors.record), else one the agent writes for it from its exit."""
        path = self._error_files.get(failure.rank)
        if path is None:
            return {}
        doc = read_error_file(path)
        if doc is None:
            doc = error_document(
                f"rank {failure.rank} (pid {failure.pid}) ended with "
                f"{describe_exit(failure.exitcode)} and wrote no error file",
                "\n".join(failure.tail), {"rank": failure.rank, "exitcode": failure.exitcode})
            try:
                write_error_file(path, doc)
            except OSError as exc:
                logger.warning("Cannot write rank %s's error file %s: %s", failure.rank, path,
                               exc)
                return {}
            return {"error_file": path}
        message = doc["message"]
        return {"error_file": path, "error": message["message"],
                "traceback": message.get("extraInfo", {}).get("py_callstack", "")}

    def _log_path(self, round_: int, rank: int) -> Optional[str]:
        if self.spec.log_dir is None:
            return None
        return os.path.join(self.spec.log_dir, self.spec.run_id, f"round_{round_}",
                            f"rank_{rank}.log")

    # ------------------------------------------------------------------ monitoring

    def _monitor(self, info: RendezvousInfo, restarts: int):
        group = self._group
        poller = RoundPoller(self.handler, self.spec.monitor_interval, group.changed).start()
        try:
            return self._watch_round(info, group, poller)
        finally:
            poller.stop()

    def _watch_round(self, info: RendezvousInfo, group: WorkerGroup, poller: RoundPoller):
        seen = 0
        unreachable_since: Optional[float] = None
        while True:
            # Worker exits and notable readings of the rendezvous wake us at once.
            group.changed.wait(self.spec.monitor_interval)
            group.changed.clear()
            if self._signum is not None:
                return self._interrupted(self._signum)
            if self._host_lost is not None:
                return self._host_lost_result()
            state = group.state()
            if state == "failed":
                return self._on_failure(info)
            if state == "succeeded":
                group.wait_output()
                return self._exit_barrier(info)
            poll = poller.latest()
            if poll is None or poll.seq == seen:
                continue
            seen = poll.seq
            now = time.monotonic()
            if poll.error is not None:
                if isinstance(poll.error, StoreHostLostError):
                    self._host_lost = self._host_lost or poll.error
                    return self._host_lost_result()
                if unreachable_since is None:
                    unreachable_since = now
                    logger.warning("Cannot read the rendezvous; the workers go on while it "
                                   "retries: %s", poll.error)
                continue
            if unreachable_since is not None:
                logger.warning("The rendezvous is back after %.1fs", now - unreachable_since)
                unreachable_since = None
            if poll.waiting > 0:
                if self._claim_round(info, "scale_up"):
                    self._signal_restart("a node is waiting to join: scaling up")
                    self._stop_workers("scaling up for a waiting node")
                    return "scale_up"
                continue
            if poll.reason is not None:
                if self.handler.is_closed():
                    self._stop_workers("the rendezvous was closed")
                    return self._closed_result()
                logger.warning("Round %s ends: %s", info.round, poll.reason)
                self._stop_workers(f"round {info.round} ends")
                lost = self._safe(self.handler.dead_nodes, [])
                return "node_lost" if lost else "peer_request"

    def _on_failure(self, info: RendezvousInfo):
        failures = self._settle_failures(info)
        if self._host_lost is not None:
            return self._host_lost_result()  # the lost store host is the cause, not a worker
        first = failures[0]
        record = {
            "round": info.round, "rank": first.rank, "local_rank": first.local_rank,
            "node": self.node_id, "pid": first.pid, "exitcode": first.exitcode,
            "exit": describe_exit(first.exitcode), "time": first.time,
            "tail": list(first.tail), "log_path": first.log_path,
        }
        for failure in failures:
            fields = self._error_file_of(failure)
            if failure is first:
                record.update(fields)
        hang, noticer = self._find_hang(failures)
        if hang is not None:
            record.update(self._blame(hang, noticer))
            logger.error("Round %s: %s hung: %s (rank %d noticed and ended with %s). "
                         "Watchdog dump: %s", info.round, hang.culprit_names(), hang.reason,
                         noticer.rank, describe_exit(noticer.exitcode), hang.dump_path)
        else:
            logger.error("Round %s: %s", info.round, first.describe())
        if first.exitcode in PEER_FAILURE_EXIT_CODES:
            lost = self._safe(self.handler.dead_nodes, [])
            if lost:
                # Our workers only lost their peers on a node that died: not a failure of ours.
                self._claim_round(info, "node_lost")
                self._signal_restart(f"node(s) {', '.join(lost)} lost")
                self._stop_workers(f"nodes {lost} were lost")
                return "node_lost"
        counted = self._claim_round(info, "worker_failure", record)
        if not counted:
            self._stop_workers(f"round {info.round} ends after a failure elsewhere")
            lost = self._safe(self.handler.dead_nodes, [])
            return "node_lost" if lost else "peer_request"
        used = int(self.store.add("agent/restarts", 1))
        metrics.JOB_RESTARTS.set(used)
        if used > self.spec.max_restarts:
            self._limit_backend()  # the job is over: recording it must not wait out etcd
            self._stop_workers("restarts are exhausted")
            summary = summary_text(self.spec.run_id, record, used - 1, self.spec.max_restarts)
            self._safe(lambda: self.store.set("agent/final_failure",
                                              json.dumps({**record, "summary": summary})))
            self._safe(self.handler.set_closed)
            return AgentResult(1, summary, self._rounds, failure={**record, "summary": summary})
        if hang is not None:
            self._signal_restart(f"{hang.culprit_names()} hung: rank {noticer.rank} on node "
                                 f"{self.node_id} timed out waiting for it")
        else:
            self._signal_restart(f"rank {first.rank} on node {self.node_id} ended with "
                                 f"{describe_exit(first.exitcode)}")
        self._stop_workers("restarting after a worker failure")
        logger.warning("Restarting the job (restart %d of %d)", used, self.spec.max_restarts)
        return "worker_failure"

    def _find_hang(self, failures: list[WorkerExit]) -> tuple[Optional[Hang], Optional[WorkerExit]]:
        """A collective timeout behind these failures, from the watchdog dumps, and the worker
        whose dump names it (the rank that noticed); (None, None) without one."""
        for failure in failures:
            if failure.exitcode in PEER_FAILURE_EXIT_CODES:
                hang = find_hang(failure.pid, self._dump_dir)
                if hang is not None:
                    return hang, failure
        return None, None

    def _blame(self, hang: Hang, detector: WorkerExit) -> dict:
        """The failure record's fields that point at the hung rank instead of the detector."""
        fields = {"hang": hang.reason, "detected_by": detector.rank,
                  "dump_path": hang.dump_path, "culprits": list(hang.culprits)}
        if hang.group != "default":
            return fields  # group ranks: the record keeps the detector as the rank
        rank = hang.culprits[0]
        fields.update(rank=rank, node=self._rank_nodes.get(rank, "?"), local_rank="?", pid="?")
        group = self._killable
        if group is not None and rank in group.ranks:
            local = group.ranks.index(rank)
            fields.update(local_rank=local, pid=group.pids[local])
        return fields

    def _settle_failures(self, info: RendezvousInfo) -> list[WorkerExit]:
        """This node's failed workers, the likeliest cause first.

        A worker that exited with the collectives' async-error code only saw a peer fail. If
        that is all we have, the cause is elsewhere: a local worker whose exit we have not
        reaped yet (milliseconds), or another node, which claims the round as soon as it sees
        its own failure, or which died (its heartbeat lapses). Wait for one of those, so the
        summary names the real cause and a lost node costs no restart.
        """
        group = self._group

        def ordered(failures: list[WorkerExit]) -> list[WorkerExit]:
            return sorted(failures, key=lambda f: (f.exitcode in PEER_FAILURE_EXIT_CODES, f.time))

        failures = group.failures()
        if any(f.exitcode not in PEER_FAILURE_EXIT_CODES for f in failures):
            return ordered(failures)
        settings = getattr(self.handler, "settings", None)
        wait = 1.0 if info.num_nodes == 1 else getattr(settings, "heartbeat_timeout", 5.0) + 1.0
        deadline = time.monotonic() + wait
        key = f"agent/round/{info.round}/ended"
        while time.monotonic() < deadline:
            group.changed.wait(self.spec.monitor_interval)
            group.changed.clear()
            failures = group.failures()
            if any(f.exitcode not in PEER_FAILURE_EXIT_CODES for f in failures):
                break
            if info.num_nodes == 1:
                if group.counts()["running"] == 0:
                    break  # every local worker is accounted for
                continue
            if self._host_lost is not None:
                break
            if self._safe(lambda: self.store.check([key]), False):
                break
            if self._safe(self.handler.dead_nodes, []):
                break
        return ordered(failures)

    def _claim_round(self, info: RendezvousInfo, why: str, record: Optional[dict] = None) -> bool:
        """End round `info.round` for `why`; True if we were first (only then does it count)."""
        key = f"agent/round/{info.round}/ended"
        mine = f"{why}:{self.node_id}"
        try:
            if record is not None:
                self.store.set(f"agent/round/{info.round}/failure/{self.node_id}",
                               json.dumps(record))
            won = self.store.compare_set(key, "", mine).decode() == mine
        except StoreError as exc:
            logger.warning("Could not record the end of round %s in the store: %s", info.round,
                           exc)
            return why == "worker_failure"  # count it: safer to over-count than loop forever
        if not won:
            logger.info("Round %s was already ended by another node; not counting it", info.round)
        return won

    def _signal_restart(self, reason: str) -> None:
        try:
            self.handler.signal_restart(reason)
        except RendezvousError as exc:
            logger.warning("Could not signal the restart through the rendezvous: %s", exc)

    # ------------------------------------------------------------------ endings

    def _exit_barrier(self, info: RendezvousInfo):
        """Wait until every node's workers succeeded; rerun if some node restarts instead."""
        base = f"agent/round/{info.round}"
        deadline = time.monotonic() + self.spec.exit_barrier_timeout
        # The barrier itself may wait long for slow nodes, but in short calls: if etcd died
        # meanwhile, a call fails in seconds and this node's success stands.
        self._limit_backend()
        try:
            if int(self.store.add(f"{base}/exit", 1)) >= info.num_nodes:
                self.store.set(f"{base}/exit_done", "1")
            while True:
                try:
                    self.store.wait([f"{base}/exit_done"], self.spec.monitor_interval)
                    break
                except StoreTimeout:
                    pass
                if self._signum is not None:
                    return self._interrupted(self._signum)
                reason = self.handler.restart_requested()
                if reason is not None:
                    if self.handler.is_closed():
                        # Closed before every node arrived: the job failed elsewhere.
                        result = self._closed_result()
                        if result.exit_code != 0:
                            return result
                        continue
                    logger.warning("Another node restarts round %s (%s): rejoining", info.round,
                                   reason)
                    return "peer_request"
                if time.monotonic() >= deadline:
                    logger.warning("The exit barrier timed out after %gs; finishing anyway",
                                   self.spec.exit_barrier_timeout)
                    break
            self._safe(self.handler.set_closed)
        except (StoreError, RendezvousError) as exc:
            logger.warning("The exit barrier failed (%s); this node's workers succeeded", exc)
        logger.info("All workers succeeded after %d round(s)", self._rounds)
        return AgentResult(0, None, self._rounds)

    def _closed_result(self) -> AgentResult:
        try:
            raw = self.store.get("agent/final_failure", 2.0)
        except (StoreError, RendezvousError):
            raw = None
        if raw:
            try:
                failure = json.loads(raw)
                summary = failure["summary"]
            except (ValueError, KeyError, TypeError):
                failure = None
                summary = "shoal run: the job failed on another node (its summary is unreadable)."
            return AgentResult(1, summary, self._rounds, failure=failure)
        if self._rounds == 0:
            return AgentResult(
                1, f"shoal run: run id {self.spec.run_id!r} belongs to a job that already ended "
                   "(its rendezvous is closed), so this node cannot join it; give a new job its "
                   "own --rdzv-id.", self._rounds)
        return AgentResult(0, None, self._rounds)

    def _interrupted(self, signum: int) -> AgentResult:
        self._interruptible = False  # handling it now: a repeated signal must not cut this short
        name = signal.Signals(signum).name
        group = self._group
        if group is not None:
            logger.warning("Stopping the workers after %s (grace period %gs)", name,
                           self.spec.grace_period)
            with self._critical():
                group.stop(self.spec.grace_period, signum)
        return AgentResult(128 + signum, f"shoal run: stopped by {name}.", self._rounds)

    # ------------------------------------------------------------------ helpers

    def _stop_workers(self, why: str) -> None:
        group, self._group = self._group, None
        if group is not None:
            if group.counts()["running"]:
                logger.info("Stopping this node's workers: %s", why)
            with self._critical():
                group.stop(self.spec.grace_period)
        self._close_master_store()

    def _close_master_store(self) -> None:
        store, self._master_store = self._master_store, None
        if store is not None:
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001  (closing must not mask the real outcome)
                logger.debug("Closing the master store failed: %s", exc)

    def _safe(self, call, default=None):
        if self._host_lost is not None:
            return default  # every store call would fail; the verdict was logged once
        try:
            return call()
        except (StoreError, RendezvousError) as exc:
            logger.warning("%s", exc)
            return default
