"""Start, watch, signal and stop one node's worker processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional, Sequence

from shoal.elastic import metrics
from shoal.elastic.agent.logs import LogTee, StreamRoute

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = None
try:  # Linux: workers die with their agent even when the agent is SIGKILLed.
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _libc = None


def _child_setup(agent_pid: int) -> None:
    # Runs in the forked child before exec: keep it to one syscall and no Python locks.
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != agent_pid:  # the agent died between fork and prctl
        os._exit(1)


# A Popen with a preexec_fn must fork the whole agent (threads, tens of MB) and run Python in
# the child: 6-18 ms per worker on a loaded 2-core machine, on every restart's critical path.
# util-linux's setpriv sets the parent-death signal and execs on, so Popen can use vfork
# (under 1 ms); a shell in between then checks, as _child_setup does, that the agent did not die
# before the signal was set (its $PPID is then no longer the agent), and execs the worker with
# the environment it was given (the shell's own PWD dropped unless the worker's had one).
_SETPRIV = shutil.which("setpriv")
_CHECK_PARENT = 'test "$PPID" = "$0" || exit 1; [ "$1" = 1 ] || unset PWD; shift; exec "$@"'


def _spawn_argv(argv: Sequence[str], env: Mapping[str, str],
                agent_pid: int) -> tuple[list[str], Optional[object]]:
    """The command line and preexec_fn that start `argv` as a worker dying with the agent."""
    if _SETPRIV is None:
        return list(argv), lambda: _child_setup(agent_pid)
    if shutil.which(argv[0], path=env.get("PATH", os.defpath)) is None:
        # What Popen would raise for it, before the shell starts.
        raise FileNotFoundError(errno.ENOENT, f"No executable {argv[0]!r} on the worker's PATH")
    return [_SETPRIV, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", _CHECK_PARENT,
            str(agent_pid), "1" if "PWD" in env else "0", *argv], None


def describe_exit(code: Optional[int]) -> str:
    """'exit code 3' or 'signal SIGKILL (exit code -9)'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"signal {name} (exit code {code})"
    return f"exit code {code}"


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How one worker ended."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    time: float  # wall clock (time.time()) when the agent saw it exit
    tail: tuple[str, ...]
    log_path: Optional[str]

    def describe(self) -> str:
        """A sentence naming the rank, pid and how it exited."""
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) ended with " \
               f"{describe_exit(self.exitcode)}"


class _Worker:
    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen, tee: LogTee):
        self.rank = rank
        self.local_rank = local_rank
        self.proc = proc
        self.tee = tee
        self.exitcode: Optional[int] = None
        self.exit_time: Optional[float] = None
        self.stopped = False  # the agent stopped it (its exit is not a failure)


class WorkerGroup:
    """This node's workers for one round: started together, watched, stopped together.

    `changed` is set whenever a worker exits, so the agent reacts at once instead of on its
    next poll.
    """

    def __init__(
        self,
        argv: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        ranks: Sequence[int],
        *,
        log_paths: Sequence[Optional[str]],
        to_console: bool,
        multiproc_dir: Optional[str],
        console_out=None,
        console_err=None,
        routes: Optional[Sequence[StreamRoute]] = None,
    ):
        self._argv = list(argv)
        # Per local rank: which streams reach the console and the log file.
        self._routes = list(routes) if routes is not None else [
            StreamRoute(console=(to_console, to_console)) for _ in ranks]
        self._envs = [dict(e) for e in envs]
        self._ranks = list(ranks)
        self._log_paths = list(log_paths)
        self._to_console = to_console
        self._multiproc_dir = multiproc_dir
        self._console_out = console_out or sys.stdout
        self._console_err = console_err or sys.stderr
        self._workers: list[_Worker] = []
        self._sent: Optional[int] = None  # the last signal forwarded to every worker
        self._lock = threading.Lock()
        self.changed = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn every worker (call from the agent's main thread: the death signal is per
        thread of the parent)."""
        agent_pid = os.getpid()
        for local_rank, (rank, env) in enumerate(zip(self._ranks, self._envs)):
            try:
                argv, preexec = _spawn_argv(self._argv, env, agent_pid)
                proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec,
                )
            except OSError as exc:
                self.stop(grace=0)
                raise OSError(
                    exc.errno, f"Cannot start rank {rank} ({' '.join(self._argv)}): {exc}"
                ) from exc
            route = self._routes[local_rank]
            tee = LogTee(rank, proc.stdout, proc.stderr, console_out=self._console_out,
                         console_err=self._console_err, to_console=route.console,
                         log_path=self._log_paths[local_rank], to_file=route.file)
            worker = _Worker(rank, local_rank, proc, tee)
            self._workers.append(worker)
            threading.Thread(target=self._reap, args=(worker,), daemon=True,
                             name=f"shoal-reap-rank{rank}").start()
        logger.info("Started ranks %s as pids %s", self._ranks,
                    [w.proc.pid for w in self._workers])
        metrics.set_worker_pids({w.rank: w.proc.pid for w in self._workers})
        self._publish_states()

    def _reap(self, worker: _Worker) -> None:
        code = worker.proc.wait()
        with self._lock:
            worker.exitcode = code
            worker.exit_time = time.time()
            stopped = worker.stopped
        metrics.forget_worker(worker.rank, worker.proc.pid)
        metrics.count_worker_exit(code, stopped)
        metrics.mark_worker_dead(worker.proc.pid, self._multiproc_dir)
        if code != 0 and not worker.stopped:
            logger.warning("Rank %s (pid %s) ended with %s", worker.rank, worker.proc.pid,
                           describe_exit(code))
        self._publish_states()
        self.changed.set()

    # ------------------------------------------------------------------ state

    @property
    def ranks(self) -> list[int]:
        """The workers' global ranks, by local rank."""
        return list(self._ranks)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, by local rank."""
        return [w.proc.pid for w in self._workers]

    def running(self) -> list[tuple[int, int]]:
        """(global rank, pid) of every worker still running."""
        with self._lock:
            return [(w.rank, w.proc.pid) for w in self._workers if w.exitcode is None]

    def counts(self) -> dict[str, int]:
        """How many workers are running, succeeded, failed, or were stopped by the agent."""
        result = {state: 0 for state in metrics.WORKER_STATES}
        with self._lock:
            for w in self._workers:
                if w.exitcode is None:
                    result["running"] += 1
                elif w.stopped:
                    result["stopped"] += 1
                elif w.exitcode == 0:
                    result["succeeded"] += 1
                else:
                    result["failed"] += 1
        return result

    def state(self) -> str:
        """'failed' once any worker failed, 'succeeded' when all exited 0, else 'running'."""
        counts = self.counts()
        if counts["failed"]:
            return "failed"
        if counts["succeeded"] == len(self._workers):
            return "succeeded"
        return "running"

    def failures(self) -> list[WorkerExit]:
        """Failed workers, earliest exit first (the first is the likeliest cause)."""
        with self._lock:
            failed = [w for w in self._workers
                      if w.exitcode not in (None, 0) and not w.stopped]
        for w in failed:  # the last lines are often the error: let the pipe drain first
            w.tee.join(1.0)
        failed.sort(key=lambda w: w.exit_time)
        return [
            WorkerExit(rank=w.rank, local_rank=w.local_rank, pid=w.proc.pid,
                       exitcode=w.exitcode, time=w.exit_time, tail=tuple(w.tee.tail()),
                       log_path=w.tee.log_path)
            for w in failed
        ]

    def _publish_states(self) -> None:
        metrics.set_worker_states(self.counts())

    # ------------------------------------------------------------------ signals

    def send_signal(self, signum: int) -> None:
        """Send `signum` to every running worker's process group (the worker and its children)."""
        self._sent = signum
        for w in self._workers:
            if w.exitcode is None:
                try:
                    os.killpg(w.proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self, grace: float, signum: int = signal.SIGTERM) -> None:
        """Stop every worker: `signum`, up to `grace` seconds, then SIGKILL; drain their output."""
        with self._lock:
            for w in self._workers:
                if w.exitcode is None:
                    w.stopped = True
        if self._sent != signum:  # a second SIGINT would cut a worker's own clean-up short
            self.send_signal(signum)
        # A stopped (SIGSTOPped, hung in a debugger) worker holds `signum` pending until it
        # runs again, also when the agent forwarded it before stopping: continue it so it can
        # act on it instead of costing the whole grace.
        self.send_signal(signal.SIGCONT)
        self._sent = signum
        deadline = time.monotonic() + grace
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if any(w.proc.poll() is None for w in self._workers):
            logger.warning("Workers %s outlived the %gs grace period; sending SIGKILL",
                           [w.rank for w in self._workers if w.proc.poll() is None], grace)
        # The group may hold children of a worker that exited: kill the whole group regardless.
        for w in self._workers:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for w in self._workers:
            try:
                w.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process in D state
                logger.error("Rank %s (pid %s) did not die after SIGKILL", w.rank, w.proc.pid)
            w.tee.join(timeout=2.0)
        self._publish_states()

    def wait_output(self, timeout: float = 5.0) -> None:
        """After the workers exited on their own, wait for their last output lines."""
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.tee.join(max(0.0, deadline - time.monotonic()))
