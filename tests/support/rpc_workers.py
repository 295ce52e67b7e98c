"""A pool of spawned RPC workers for the rpc_agent tests.

`RpcWorkers(n)` spawns n processes that each run `init_rpc("w<rank>")` against a TCPStore the
test process hosts, then run tasks (module-level functions) sent to them and send back their
results or their exceptions with the rank and traceback. One pool serves a whole test module;
fault tests start their own small groups.

Worker processes keep every log record in `LOGS`, so that a task can check what was logged.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue as queue_mod
import signal
import threading
import time
import traceback
from typing import Any, Callable, Optional

from tests.support import report_pipes


CTX = multiprocessing.get_context("spawn")
LOGS: list[str] = []


class WorkerFailed(AssertionError):
    """A task raised on a worker, or a worker died or hung; the message says which."""


class _ListHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOGS.append(f"{record.levelname} {record.name}: {record.getMessage()}")


class _Replies:
    """A worker's side of its reply pipe: replies leave from a thread of their own, so a task's
    large result never holds the worker while the test is busy elsewhere; `close()` sends what
    is queued before the worker exits."""

    def __init__(self, pipe):
        self._pipe = pipe
        self._queue: queue_mod.Queue = queue_mod.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-replies")
        self._thread.start()

    def put(self, reply: tuple) -> None:
        self._queue.put(report_pipes.frame(reply))

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            report_pipes.write_all(self._pipe.fileno(), data)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(30)
        self._pipe.close()


def _worker_main(rank: int, world_size: int, env: dict, commands, reply_pipe, init: bool,
                 options: dict) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    logging.getLogger().addHandler(_ListHandler())
    logging.getLogger().setLevel(logging.INFO)
    results = _Replies(reply_pipe)
    try:
        _serve(rank, world_size, commands, results, init, options)
    finally:
        results.close()


def _serve(rank, world_size, commands, results, init, options) -> None:
    try:
        if init:
            from shoal import rpc_agent

            rpc_agent.init_rpc(
                f"w{rank}", rank, world_size,
                rpc_agent.RpcBackendOptions(init_method="env://", **options),
            )
        results.put(("ready", rank, "ok", None))
    except BaseException as exc:  # noqa: BLE001  (sent to the parent)
        results.put(("ready", rank, "error", _describe(exc)))
        return
    while True:
        command = commands.get()
        if command is None:
            return
        task_id, fn, args, kwargs = command
        try:
            value = fn(*args, **kwargs)
            results.put((task_id, rank, "ok", value))
        except BaseException as exc:  # noqa: BLE001
            results.put((task_id, rank, "error", _describe(exc)))


def _describe(exc: BaseException) -> tuple[str, str, str]:
    return type(exc).__name__, str(exc), traceback.format_exc()


class RpcWorkers:
    """`world_size` spawned RPC workers named w0..w{n-1}; use as a context manager."""

    def __init__(self, world_size: int, *, init: bool = True, env: Optional[dict] = None,
                 ready_timeout: float = 60.0, **options: Any):
        from shoal.collectives.store.tcp import TCPStore

        self.world_size = world_size
        self.store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30, wait_for_workers=False)
        child_env = {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
            "SHOAL_USE_AGENT_STORE": "1",
        }
        child_env.update(env or {})
        options.setdefault("rpc_timeout", 30)
        options.setdefault("init_timeout", 60)
        self._ids = itertools.count()
        self._commands = [CTX.Queue() for _ in range(world_size)]
        self._done: dict[int, tuple] = {}
        self._ready: set[int] = set()
        self._task_rank: dict[int, int] = {}
        pipes = [CTX.Pipe(duplex=False) for _ in range(world_size)]
        # One reply pipe per worker, its writing end in the worker alone: a worker that dies,
        # even halfway through a reply, reads as end-of-file (see report_pipes).
        self._replies = [report_pipes.Reader(reader) for reader, _ in pipes]
        self.procs = [
            CTX.Process(
                target=_worker_main,
                args=(r, world_size, child_env, self._commands[r], pipes[r][1], init, options),
                name=f"rpc-w{r}", daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        for _, writer in pipes:
            writer.close()
        try:
            self._collect_ready(ready_timeout)
        except BaseException:
            self.close()
            raise

    def _gather(self, timeout: float) -> None:
        """File the replies that arrive within `timeout`."""
        live = [r for r in self._replies if not r.eof]
        for reader in report_pipes.ready(live, timeout):
            reader.pump()
            while (reply := reader.take()) is not None:
                tag, rank, status, value = reply
                if tag == "ready":
                    if status != "ok":
                        raise WorkerFailed(f"RPC worker w{rank} failed to start: {value[0]}: "
                                           f"{value[1]}\n{value[2]}")
                    self._ready.add(rank)
                else:
                    self._done[tag] = (rank, status, value)

    def _gone(self, rank: int) -> str:
        """Why worker `rank` will send nothing more, or '' while it may."""
        reader = self._replies[rank]
        if not reader.eof:
            return ""
        self.procs[rank].join(5)
        half = f", {len(reader.buffer)} bytes of a reply unfinished" if reader.buffer else ""
        return f"worker w{rank} exited (exit code {self.procs[rank].exitcode}{half})"

    def _collect_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while len(self._ready) < self.world_size:
            missing = sorted(set(range(self.world_size)) - self._ready)
            gone = [why for why in map(self._gone, missing) if why]
            if gone:
                raise WorkerFailed(f"RPC workers did not start: {'; '.join(gone)}.")
            if time.monotonic() >= end:
                codes = {r: self.procs[r].exitcode for r in missing}
                raise WorkerFailed(
                    f"RPC workers {missing} were not ready within {timeout:g}s "
                    f"(exit codes {codes})."
                )
            self._gather(min(0.5, max(0.0, end - time.monotonic())))

    # -- tasks

    def submit(self, rank: int, fn: Callable, *args, **kwargs) -> int:
        """Start `fn(*args, **kwargs)` on worker `rank`; returns a task id for `result`."""
        task_id = next(self._ids)
        self._task_rank[task_id] = rank
        self._commands[rank].put((task_id, fn, args, kwargs))
        return task_id

    def result(self, task_id: int, timeout: float = 60.0) -> Any:
        """The value of a task; raises WorkerFailed with the worker's traceback if it raised."""
        end = time.monotonic() + timeout
        while task_id not in self._done:
            remaining = end - time.monotonic()
            gone = self._gone(self._task_rank[task_id])
            if gone:
                raise WorkerFailed(f"Task {task_id} gave no result: {gone}.")
            if remaining <= 0:
                dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
                raise WorkerFailed(
                    f"Task {task_id} gave no result within {timeout:g}s (dead workers and "
                    f"exit codes: {dead})."
                )
            self._gather(min(remaining, 1.0))
        del self._task_rank[task_id]
        rank, status, value = self._done.pop(task_id)
        if status != "ok":
            raise WorkerFailed(
                f"Task {task_id} raised on w{rank}: {value[0]}: {value[1]}\n{value[2]}"
            )
        return value

    def run(self, rank: int, fn: Callable, *args, timeout: float = 60.0, **kwargs) -> Any:
        """`fn(*args, **kwargs)` on worker `rank`, waited for."""
        return self.result(self.submit(rank, fn, *args, **kwargs), timeout)

    def run_all(self, fn: Callable, *args, timeout: float = 60.0, **kwargs) -> list:
        """`fn` on every worker at once; their values by rank."""
        ids = [self.submit(r, fn, *args, **kwargs) for r in range(self.world_size)]
        return [self.result(i, timeout) for i in ids]

    # -- faults and teardown

    def kill(self, rank: int) -> None:
        """SIGKILL worker `rank` and reap it."""
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(10)

    def shutdown(self, timeout: float = 60.0, ranks=None) -> None:
        """Graceful rpc shutdown on `ranks` (default all, at once), then let them exit."""
        from shoal import rpc_agent

        ranks = range(self.world_size) if ranks is None else ranks
        ids = [self.submit(r, rpc_agent.shutdown) for r in ranks]
        for task_id in ids:
            self.result(task_id, timeout)
        self.close()

    def close(self) -> None:
        """Stop the workers (killing any that do not exit within a few seconds)."""
        for rank, proc in enumerate(self.procs):
            if proc.is_alive():
                self._commands[rank].put(None)
        for rank, proc in enumerate(self.procs):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for reader in self._replies:
            reader.close()
        self.store.close()

    def __enter__(self) -> "RpcWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def expect_error(workers: RpcWorkers, rank: int, fn: Callable, *args, timeout: float = 60.0,
                 **kwargs) -> tuple[str, str, str]:
    """Run a task that must raise; return (type name, message, traceback)."""
    try:
        value = workers.run(rank, fn, *args, timeout=timeout, **kwargs)
    except WorkerFailed as exc:
        text = str(exc)
        head, _, tb = text.partition("\n")
        type_and_message = head.split(": ", 1)[1]
        type_name, _, message = type_and_message.partition(": ")
        return type_name, message, tb
    raise AssertionError(f"{fn.__name__} was expected to raise on w{rank}, returned {value!r}.")


# ----------------------------------------------------------------------------- tests of init
