"""The node agent: one per node, it runs this node's workers through rendezvous rounds.

Each round: join the rendezvous, host (node rank 0) or look up the workers' TCPStore, start the
local workers with torchrun's environment, and watch them. A worker failure stops this node's
workers and ends the round for every node at once (through the rendezvous, not a collective
timeout); then everyone meets again and restarts from the last checkpoint. Restarts are
counted for the whole job in the run's store, once per round whichever node saw the failure
first (`ledger` holds the keys the agents share). A lost node or a waiting one ends the round
too, without costing a restart.

The parts beside this round loop: `spec` (what to run, how it ended), `signals` (SIGTERM and
friends), `round_setup` (ranks and environments), `monitor` (watching a running round),
`failures` (which worker caused a failure, and its record).
"""

from __future__ import annotations

import logging
import signal
import tempfile
import time
from typing import Callable, Optional, Union

from shoal.collectives import settings as collectives_settings
from shoal.collectives.types import StoreError, StoreTimeout
from shoal.elastic import metrics
from shoal.elastic.agent import failures, ledger, noticing
from shoal.elastic.agent.env import default_node_id, python_argv, summary_text
from shoal.elastic.agent.logs import RepeatLimiter
from shoal.elastic.agent.monitor import EventKind, RoundWatch
from shoal.elastic.agent.round_poll import RoundPoller
from shoal.elastic.agent.round_setup import (
    RoundPlan,
    log_path,
    next_sniff,
    open_master_store,
    plan_round,
)
from shoal.elastic.agent.store_door import SNIFF_S
from shoal.elastic.agent.signals import SignalGate
from shoal.elastic.agent.spec import (
    DEFAULT_EXIT_BARRIER_TIMEOUT_S,
    DEFAULT_MASTER_TIMEOUT_S,
    EXIT_BUDGET_S,
    EXIT_CALL_TIMEOUT_S,
    PEER_FAILURE_EXIT_CODES,
    AgentInterrupted,
    AgentResult,
    WorkerSpec,
)
from shoal.elastic.agent.workers import WorkerGroup, describe_exit
from shoal.elastic.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousTimeoutError,
    StoreHostLostError,
)
from shoal.elastic.rendezvous.sealing import ForgedValueError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_EXIT_BARRIER_TIMEOUT_S", "DEFAULT_MASTER_TIMEOUT_S", "EXIT_BUDGET_S",
           "EXIT_CALL_TIMEOUT_S", "PEER_FAILURE_EXIT_CODES", "Agent", "AgentInterrupted",
           "AgentResult", "WorkerSpec", "default_node_id", "python_argv"]

_STORE_ACK_TIMEOUT_S = 5.0
_FINAL_FAILURE_READ_S = 2.0

# What a round ends with: a restart reason ("worker_failure", "node_lost", "scale_up",
# "peer_request"), or the agent's final result.
Outcome = Union[str, AgentResult]


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
        self._door_sniff = SNIFF_S  # the next door's sniff window (round_setup.next_sniff)
        self._rounds = 0
        self._last_info: Optional[RendezvousInfo] = None
        self._host_lost: Optional[StoreHostLostError] = None
        self._gate = SignalGate(spec.grace_period, forward=self._forward_signal,
                                on_first=self._limit_backend, kill=self._kill_workers)
        self._killable: Optional[WorkerGroup] = None  # for the last-resort exit after a signal
        # Where the workers' watchdogs write their dumps (read to blame a hung rank), and the
        # current round's plan (which node runs each global rank, the error files).
        self._dump_dir = (spec.dump_dir or collectives_settings.DUMP_DIR.get(spec.base_env)
                          or tempfile.gettempdir())
        self._plan: Optional[RoundPlan] = None
        # The best-effort calls' failures (_safe): a dead store fails ten a second.
        self._quiet = RepeatLimiter(logger)
        metrics.set_run_id(spec.run_id)
        metrics.set_dump_dir(self._dump_dir)

    @property
    def store(self):
        """The job's keys: the run's store scoped to the job the rendezvous joined (a new job
        under a used run id starts clean), or the whole store for handlers without scoping."""
        scoped = getattr(self.handler, "job_store", None)
        return scoped if scoped is not None else self.handler.store

    def store_host_lost(self, error: StoreHostLostError) -> None:
        """The run's store is gone with its host (see elastic.agent.store_host): end this agent.

        Called from the watch's thread; the main loop notices at once and stops the workers.
        """
        self._host_lost = error
        group = self._group
        if group is not None:
            group.changed.set()

    def install_signal_handlers(self) -> Callable[[], None]:
        """Forward the spec's signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default) to the
        workers and end the agent; returns a restorer."""
        return self._gate.install(self.spec.signals)

    def _forward_signal(self, signum: int) -> None:
        group = self._group
        if group is not None:
            group.send_signal(signum)
            group.changed.set()

    def _kill_workers(self) -> None:
        group = self._killable
        if group is not None:
            group.send_signal(signal.SIGKILL)

    def _limit_backend(self, until: Optional[float] = None) -> None:
        """Bound every rendezvous/store call from now on (see EXIT_CALL_TIMEOUT_S)."""
        limit = getattr(self.handler, "limit", None)
        if limit is not None:
            limit(EXIT_CALL_TIMEOUT_S, until)

    # ------------------------------------------------------------------ the round loop

    def run(self) -> AgentResult:
        """Run rounds until done; never raises for worker failures (see the exit code).

        On return the agent has left the rendezvous (`handler.shutdown()`); closing the
        handler's backend and store is the caller's job, after this returns.
        """
        try:
            with self._gate.interruptible():
                result = self._run()
        except AgentInterrupted as exc:
            result = self._interrupted(exc.signum)
        finally:
            self._stop_workers("the agent is exiting")
            self._close_master_store()
        self._limit_backend(time.monotonic() + EXIT_BUDGET_S)
        self._leave(result)
        return result

    def _run(self) -> AgentResult:
        while True:
            if self._gate.signum is not None:
                return self._interrupted(self._gate.signum)
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
                if isinstance(exc, ForgedValueError):
                    return self._forged_result(exc)
                if self._host_lost is not None or isinstance(exc, StoreHostLostError):
                    self._host_lost = self._host_lost or exc
                    return self._host_lost_result()
                # The store or rendezvous failed mid-round (its host died, etcd is away for
                # longer than the retries): stop here and meet again; the rendezvous retries
                # up to its own timeout and ends the agent if the backend stays away.
                logger.error("Round %s lost the rendezvous or its store (%s); stopping the "
                             "workers and meeting again", info.round, exc)
                self._meet_again()
                self._stop_workers(f"round {info.round} lost its store")
                outcome = "peer_request"
            if isinstance(outcome, AgentResult):
                return outcome
            metrics.note_restart(outcome)

    def _rendezvous(self) -> RendezvousInfo:
        # Only _run calls this, while the gate is interruptible: a signal ends the join at once.
        started = time.monotonic()
        self._gate.raise_if_signalled()
        info = self.handler.next_rendezvous()
        metrics.observe_rendezvous(time.monotonic() - started, info.round)
        self._rounds += 1
        self._last_info = info
        return info

    def _run_round(self, info: RendezvousInfo) -> Outcome:
        """Start and watch one round's workers; return a restart reason or a final result."""
        try:
            plan = self._prepare(info)
        except (StoreError, RendezvousError) as exc:
            if isinstance(exc, ForgedValueError):
                return self._forged_result(exc)
            self._meet_again()
            if self.handler.is_closed():
                return self._closed_result(f"round {info.round} was starting here")
            logger.warning("Round %s could not start (%s); meeting again", info.round, exc)
            self._signal_restart(f"node {self.node_id} could not start round {info.round}: {exc}")
            return "peer_request"
        self._group = WorkerGroup(
            list(self.spec.argv), plan.envs, plan.ranks,
            log_paths=[log_path(self.spec, info.round, rank) for rank in plan.ranks],
            to_console=self.spec.tee or self.spec.log_dir is None,
            multiproc_dir=self.spec.multiproc_dir, console_out=self._console_out,
            console_err=self._console_err, routes=self.spec.routes,
        )
        logger.info("Round %s: node rank %d of %d runs ranks %s of %d (restart %d)",
                    info.round, info.group_rank, info.num_nodes, plan.ranks, plan.world_size,
                    plan.restarts)
        self._killable = self._group
        with self._gate.critical():
            self._group.start()
        poller = RoundPoller(self.handler, self.spec.monitor_interval,
                             self._group.changed).start()
        try:
            return self._watch(info, self._group, poller)
        finally:
            poller.stop()

    def _prepare(self, info: RendezvousInfo) -> RoundPlan:
        """Agree on the master store, every node's worker count, and the restart count."""
        ledger.publish_nproc(info.store, info.group_rank, self.spec.nproc_per_node)
        if info.group_rank == 0:
            self._close_master_store()
            self._master_store = open_master_store(self.spec, self._door_sniff)
            info.publish_master(self.spec.local_addr, self._master_store.port)
            master_addr, master_port = self.spec.local_addr, self._master_store.port
        else:
            master_addr, master_port = info.read_master(self.spec.master_timeout)
        counts = ledger.read_nprocs(info.store, info.num_nodes, self.spec.master_timeout)
        restarts = ledger.restarts_used(self.store)
        metrics.set_job(self.spec.run_id, sum(counts), info.num_nodes, self.spec.max_restarts,
                        restarts)
        self._plan = plan_round(self.spec, info, counts, master_addr=master_addr,
                                master_port=master_port, restarts=restarts,
                                dump_dir=self._dump_dir)
        return self._plan

    def _watch(self, info: RendezvousInfo, group: WorkerGroup, poller: RoundPoller) -> Outcome:
        """Act on what happens in the running round until it ends."""
        watch = RoundWatch(group, poller, self.spec.monitor_interval,
                           signalled=lambda: self._gate.signum is not None,
                           host_lost=lambda: self._host_lost is not None)
        while True:
            event = watch.next_event()
            if event.kind is EventKind.INTERRUPTED:
                return self._interrupted(self._gate.signum)
            if event.kind is EventKind.HOST_LOST:
                self._host_lost = self._host_lost or event.error
                return self._host_lost_result()
            if event.kind is EventKind.FORGED:
                return self._forged_result(event.error)
            if event.kind is EventKind.FAILED:
                return self._on_failure(info)
            if event.kind is EventKind.SUCCEEDED:
                group.wait_output()
                return self._exit_barrier(info)
            if event.kind is EventKind.WAITING:
                if ledger.claim_round(self.store, info.round, "scale_up", self.node_id):
                    self._meet_again()
                    self._signal_restart("a node is waiting to join: scaling up")
                    self._stop_workers("scaling up for a waiting node")
                    return "scale_up"
                continue
            self._meet_again()
            if self.handler.is_closed():
                self._stop_workers("the rendezvous was closed")
                return self._closed_result(
                    f"this node's workers were still running round {info.round}")
            logger.warning("Round %s ends: %s", info.round, event.reason)
            self._stop_workers(f"round {info.round} ends")
            return self._lost_or_requested()

    # ------------------------------------------------------------------ restart policy

    def _on_failure(self, info: RendezvousInfo) -> Outcome:
        """A local worker failed: report it, then restart the job or, with no restarts left,
        end it for every node."""
        self._meet_again()
        found = self._settle_failures(info)
        if self._host_lost is not None:
            return self._host_lost_result()  # the lost store host is the cause, not a worker
        self._let_peers_count(found)
        first = found[0]
        record = failures.failure_record(info.round, self.node_id, first)
        plan = self._plan
        error_files = plan.error_files if plan is not None else {}
        for failure in found:
            fields = failures.error_file_fields(error_files.get(failure.rank), failure)
            if failure is first:
                record.update(fields)
        hang, noticer = failures.hang_behind(found, self._dump_dir)
        if hang is not None:
            record.update(failures.blame(hang, noticer, plan.rank_nodes if plan else {},
                                         self._killable))
            logger.error("Round %s: %s hung: %s (rank %d noticed and ended with %s). "
                         "Watchdog dump: %s", info.round, hang.culprit_names(), hang.reason,
                         noticer.rank, describe_exit(noticer.exitcode), hang.dump_path)
        elif record.get("error"):
            # The worker's own root cause (torch's or shoal's @record), beside how it ended.
            logger.error("Round %s: %s; its error: %s", info.round, first.describe(),
                         record["error"])
        else:
            logger.error("Round %s: %s", info.round, first.describe())
        if failures.is_peer_failure(first):
            lost = self._safe(self.handler.dead_nodes, [])
            if lost:
                # Our workers only lost their peers on a node that died: not a failure of ours.
                ledger.claim_round(self.store, info.round, "node_lost", self.node_id)
                self._signal_restart(f"node(s) {', '.join(lost)} lost")
                self._stop_workers(f"nodes {lost} were lost")
                return "node_lost"
        if not ledger.claim_round(self.store, info.round, "worker_failure", self.node_id, record):
            self._stop_workers(f"round {info.round} ends after a failure elsewhere")
            return self._lost_or_requested()
        used = ledger.count_restart(self.store)
        metrics.JOB_RESTARTS.set(used)
        if used > self.spec.max_restarts or failures.not_retryable(record):
            # A fault a restart would only repeat (a full or read-only checkpoint disk) ends
            # the job now instead of spending every restart on the same failing save.
            return self._fail_for_good(record, used)
        self._signal_restart(failures.restart_reason(hang, noticer, first, self.node_id))
        self._stop_workers("restarting after a worker failure")
        logger.warning("Restarting the job (restart %d of %d)", used, self.spec.max_restarts)
        return "worker_failure"

    def _let_peers_count(self, found) -> None:
        """A worker killed by a signal said no goodbye: its running peers count the lost peer
        (shoal_collectives_errors_total) before they are stopped (see agent.noticing)."""
        group = self._group
        if group is None or not any(f.exitcode is not None and f.exitcode < 0 for f in found):
            return
        late = noticing.wait_until_counted(group, self.spec.multiproc_dir)
        if late:
            logger.warning("Ranks %s counted no failure within %gs of their peer's death (their "
                           "group may be gone already); stopping them anyway", late,
                           noticing.NOTICE_WAIT_S)

    def _fail_for_good(self, record: dict, used: int) -> AgentResult:
        """Restarts are exhausted: publish the failure and close the rendezvous."""
        self._limit_backend()  # the job is over: recording it must not wait out etcd
        self._stop_workers("restarts are exhausted")
        summary = summary_text(self.spec.run_id, record, used - 1, self.spec.max_restarts)
        final = {**record, "summary": summary}
        self._safe(lambda: ledger.record_final_failure(self.store, final))
        self._safe(lambda: self.handler.set_closed("failed"))
        return AgentResult(1, summary, self._rounds, failure=final)

    def _settle_failures(self, info: RendezvousInfo):
        """This node's failed workers, the likeliest cause first (see failures.settle)."""
        settings = getattr(self.handler, "settings", None)
        single = info.num_nodes == 1
        key = ledger.ended_key(info.round)

        def cause_found() -> bool:
            return (self._host_lost is not None
                    or bool(self._safe(lambda: self.store.check([key]), False))
                    or bool(self._safe(self.handler.dead_nodes, [])))

        wait = failures.settle_wait(single, getattr(settings, "heartbeat_timeout", 5.0))
        return failures.settle(self._group, wait=wait, interval=self.spec.monitor_interval,
                               single_node=single, cause_found=cause_found)

    def _meet_again(self) -> None:
        """The round is over: the calls from here to the next join share its outage budget
        (join_outage_timeout), so a dead backend ends the agent that long after the round
        ended, not after every call of the way there waited out its own timeout."""
        meet_again = getattr(self.handler, "meet_again", None)  # stand-ins lack it
        if meet_again is not None:
            meet_again()

    def _lost_or_requested(self) -> str:
        """Why a round another node ended is over: a node was lost, or a peer asked."""
        return "node_lost" if self._safe(self.handler.dead_nodes, []) else "peer_request"

    def _signal_restart(self, reason: str) -> None:
        try:
            self.handler.signal_restart(reason)
        except RendezvousError as exc:
            logger.warning("Could not signal the restart through the rendezvous: %s", exc)

    # ------------------------------------------------------------------ endings

    def _exit_barrier(self, info: RendezvousInfo) -> Outcome:
        """Wait until every node's workers succeeded; rerun if some node restarts instead."""
        deadline = time.monotonic() + self.spec.exit_barrier_timeout
        # The barrier itself may wait long for slow nodes, but in short calls: if etcd died
        # meanwhile, a call fails in seconds and this node's success stands.
        self._limit_backend()
        try:
            ledger.arrive_at_exit(self.store, info.round, info.num_nodes)
            while True:
                try:
                    self.store.wait([ledger.exit_done_key(info.round)],
                                    self.spec.monitor_interval)
                    break
                except StoreTimeout:
                    pass
                if self._gate.signum is not None:
                    return self._interrupted(self._gate.signum)
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

    def _closed_result(self, unfinished: Optional[str] = None) -> AgentResult:
        """The result once the rendezvous is closed. `unfinished` says what this node was
        doing when a close it did not expect arrived: unless the job failed for good (the
        final failure), that is never a success, whoever closed it."""
        try:
            final = ledger.read_final_failure(self.store, _FINAL_FAILURE_READ_S)
        except (StoreError, RendezvousError):
            final = None
        if final is not None:
            summary, failure = final
            return AgentResult(1, summary, self._rounds, failure=failure)
        if self._rounds == 0:
            return AgentResult(
                1, f"shoal run: run id {self.spec.run_id!r} belongs to a job that already ended "
                   "(its rendezvous is closed), so this node cannot join it; give a new job its "
                   "own --rdzv-id.", self._rounds)
        if unfinished is not None:
            closer = getattr(self.handler, "closed_by", lambda: "")()  # stand-ins lack it
            return AgentResult(
                1, f"shoal run: the rendezvous of run {self.spec.run_id!r} was closed{closer} "
                   f"while {unfinished}: this node's work is unfinished, so it does not report "
                   "success.", self._rounds)
        return AgentResult(0, None, self._rounds)

    def _forged_result(self, error: RendezvousError) -> AgentResult:
        self._stop_workers("a forged rendezvous value was read")
        return AgentResult(1, f"shoal run: {error}", self._rounds)

    def _host_lost_result(self) -> AgentResult:
        self._stop_workers("the store host is gone")
        return AgentResult(1, f"shoal run: {self._host_lost}", self._rounds)

    def _interrupted(self, signum: int) -> AgentResult:
        self._gate.hold()
        name = signal.Signals(signum).name
        group = self._group
        if group is not None:
            logger.warning("Stopping the workers after %s (grace period %gs)", name,
                           self.spec.grace_period)
            with self._gate.critical():
                group.stop(self.spec.grace_period, signum)
        return AgentResult(128 + signum, f"shoal run: stopped by {name}.", self._rounds)

    def _leave(self, result: AgentResult) -> None:
        """Leave the rendezvous; when the job is over, the store's host waits for the others.

        Each node writes its goodbye only after its own `shutdown()`, so the host (whose
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
            self._safe(lambda: self.store.set(ledger.bye_key(self.node_id), "1"))
            if result.exit_code == 0:
                # The last node out of a finished job drops its keys (etcd keeps them
                # otherwise); a failed job keeps them for diagnosis and for late joiners.
                gone = self._safe(lambda: int(self.store.add(ledger.GONE, 1)), 0)
                if gone >= info.num_nodes:
                    release = getattr(self.handler, "release_job_keys", None)
                    if release is not None:
                        self._safe(release)
            return
        others = ledger.goodbye_keys(info.participants, self.node_id)
        if others:
            try:
                self.store.wait(others, _STORE_ACK_TIMEOUT_S)
            except StoreError:
                logger.warning("Not every node said goodbye within %gs; stopping the store "
                               "anyway", _STORE_ACK_TIMEOUT_S)

    # ------------------------------------------------------------------ helpers

    def _stop_workers(self, why: str) -> None:
        group, self._group = self._group, None
        if group is not None:
            if group.counts()["running"]:
                logger.info("Stopping this node's workers: %s", why)
            with self._gate.critical():
                group.stop(self.spec.grace_period)
        self._close_master_store()

    def _close_master_store(self) -> None:
        store, self._master_store = self._master_store, None
        if store is not None:
            self._door_sniff = next_sniff(store.met_torch, store.relayed, self._door_sniff)
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
            self._quiet.warning(str(exc))
            return default
