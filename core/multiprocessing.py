"""torch.multiprocessing's `spawn` for scripts that start their own ranks, with torch's semantics.

`spawn(fn, args, nprocs)` runs fn(i, *args) in nprocs fresh processes. When one fails, the others
are stopped (SIGTERM, then SIGKILL after a grace period) and the parent raises: a child's
exception as ProcessRaisedException carrying the child's traceback, a child killed by a signal
or exiting non-zero as ProcessExitedException naming the signal or the code. Beyond torch:
`timeout=` bounds the whole run (ProcessTimeoutError names the ranks still running, after
stopping them), and the child's traceback travels as plain UTF-8 text, not a pickle.

The standard library's names torch.multiprocessing re-exports (Process, Queue, get_context...)
are re-exported here too; core Tensors pickle through their numpy arrays, so they pass through
queues as they are (copied, not shared: there is no shared-memory tensor transport).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing import (  # noqa: F401 - torch.multiprocessing re-exports these
    Barrier,
    Event,
    Lock,
    Manager,
    Pipe,
    Pool,
    Process,
    Queue,
    SimpleQueue,
    cpu_count,
    get_all_start_methods,
    get_context,
    get_start_method,
    set_start_method,
)
from typing import Any, Callable

from shoal.core.errors import ShoalError

_START_METHODS = ("spawn", "fork", "forkserver")
_PR_SET_PDEATHSIG = 1


class ProcessException(ShoalError):
    """A spawned process failed; `error_index` is its rank i, `error_pid` its pid."""

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    def __reduce__(self) -> Any:
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """A spawned process raised; the message ends with the child's own traceback."""


class ProcessExitedException(ProcessException):
    """A spawned process was killed by a signal (`signal_name`) or exited with `exit_code`."""

    def __init__(
        self, msg: str, error_index: int, error_pid: int, exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> Any:
        return type(self), (self.msg, self.error_index, self.error_pid, self.exit_code,
                            self.signal_name)


class ProcessTimeoutError(ProcessException, TimeoutError):
    """spawn(timeout=...) ran out while processes were still running (they were stopped)."""


def _die_with_parent() -> None:
    """Ask Linux to SIGINT this child when its parent dies, so no rank outlives a killed job."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGINT))
    except OSError:
        pass  # no libc by that name (musl): the child simply is not tied to its parent


def _run_child(fn: Callable, i: int, args: tuple, error_file: str) -> None:
    """A child's body: fn(i, *args); an exception's traceback goes to error_file, exit code 1."""
    _die_with_parent()
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # the parent stopping us (SIGINT) is not this rank's failure
    except Exception:  # noqa: BLE001 - whatever the user's fn raised is reported to the parent
        text = traceback.format_exc()
        tmp = error_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, error_file)  # the parent never reads half a traceback
        sys.exit(1)


class ProcessContext:
    """The processes one spawn started; join() waits for them and raises the first failure."""

    def __init__(self, processes: list, error_dir: str) -> None:
        self.processes = processes
        self._error_dir = error_dir
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}

    def pids(self) -> list[int]:
        """The children's pids, by rank."""
        return [p.pid for p in self.processes]

    def _error_file(self, i: int) -> str:
        return os.path.join(self._error_dir, f"rank{i}.traceback")

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait up to timeout for a process to end: True once all ended well, False if some
        still run; on a failure, stop the rest and raise a ProcessException for it."""
        if not self.sentinels:
            return True
        ready = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        failed = None
        for sentinel in ready:
            i = self.sentinels.pop(sentinel)
            self.processes[i].join()
            if self.processes[i].exitcode != 0:
                failed = i
                break
        if failed is None:
            if not self.sentinels:
                shutil.rmtree(self._error_dir, ignore_errors=True)
                return True
            return False
        self.stop(grace_period)
        raise self._failure(failed)

    def stop(self, grace_period: float | None = None) -> None:
        """Stop every process still running: wait grace_period, SIGTERM, wait, then SIGKILL."""
        if grace_period is not None:
            self._wait_all(grace_period)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        self._wait_all(30.0 if grace_period is None else grace_period)
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()
        self.sentinels.clear()

    def _wait_all(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))

    def _failure(self, i: int) -> ProcessException:
        proc = self.processes[i]
        try:
            with open(self._error_file(i), encoding="utf-8") as fh:
                trace = fh.read()
        except FileNotFoundError:
            trace = None
        finally:
            shutil.rmtree(self._error_dir, ignore_errors=True)
        if trace is not None:
            msg = f"\n\n-- Process {i} terminated with the following error:\n{trace}"
            return ProcessRaisedException(msg, i, proc.pid)
        code = proc.exitcode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"<Unknown signal {-code}>"
            return ProcessExitedException(
                f"process {i} terminated with signal {name}", i, proc.pid, code, name
            )
        return ProcessExitedException(f"process {i} terminated with exit code {code}", i, proc.pid,
                                      code)


def start_processes(
    fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
    start_method: str = "spawn", *, timeout: float | None = None,
) -> ProcessContext | None:
    """Start nprocs processes running fn(i, *args); join them unless join=False."""
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}.")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}.")
    if start_method not in _START_METHODS:
        raise ValueError(
            f"spawn: start_method must be one of {_START_METHODS}, got {start_method!r}."
        )
    if timeout is not None and timeout <= 0:
        raise ValueError(f"spawn: timeout must be positive seconds or None, got {timeout!r}.")
    ctx = multiprocessing.get_context(start_method)
    error_dir = tempfile.mkdtemp(prefix="shoal-spawn-")
    processes = []
    for i in range(nprocs):
        p = ctx.Process(
            target=_run_child,
            args=(fn, i, tuple(args), os.path.join(error_dir, f"rank{i}.traceback")),
            daemon=daemon,
        )
        p.start()
        processes.append(p)
    context = ProcessContext(processes, error_dir)
    if not join:
        return context
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            running = [i for i in context.sentinels.values()]
            context.stop(grace_period=1.0)
            shutil.rmtree(error_dir, ignore_errors=True)
            ranks = ", ".join(map(str, running))
            raise ProcessTimeoutError(
                f"spawn: process(es) {ranks} of {nprocs} still running after {timeout}s; "
                "stopped them (SIGTERM, then SIGKILL).",
                running[0], processes[running[0]].pid,
            )
    return None


def spawn(
    fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
    start_method: str = "spawn", *, timeout: float | None = None,
) -> ProcessContext | None:
    """Run fn(i, *args) for i in range(nprocs) in new processes, as torch.multiprocessing.spawn."""
    return start_processes(fn, args, nprocs, join, daemon, start_method, timeout=timeout)
