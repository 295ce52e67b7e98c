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
import time
import traceback
from typing import Any, Callable, Optional


CTX = multiprocessing.get_context("spawn")
LOGS: list[str] = []


class WorkerFailed(AssertionError):
    """A task raised on a worker, or a worker died or hung; the message says which."""


class _ListHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOGS.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _worker_main(rank: int, world_size: int, env: dict, commands, results, init: bool,
                 options: dict) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    logging.getLogger().addHandler(_ListHandler())
    logging.getLogger().setLevel(logging.INFO)
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
        self._results = CTX.Queue()
        self._commands = [CTX.Queue() for _ in range(world_size)]
        self._done: dict[int, tuple] = {}
        self.procs = [
            CTX.Process(
                target=_worker_main,
                args=(r, world_size, child_env, self._commands[r], self._results, init, options),
                name=f"rpc-w{r}", daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        try:
            self._collect_ready(ready_timeout)
        except BaseException:
            self.close()
            raise

    def _collect_ready(self, timeout: float) -> None:
        ready: set[int] = set()
        end = time.monotonic() + timeout
        while len(ready) < self.world_size:
            try:
                item = self._results.get(timeout=max(0.1, end - time.monotonic()))
            except queue_mod.Empty:
                missing = sorted(set(range(self.world_size)) - ready)
                codes = {r: self.procs[r].exitcode for r in missing}
                raise WorkerFailed(
                    f"RPC workers {missing} were not ready within {timeout:g}s "
                    f"(exit codes {codes})."
                ) from None
            tag, rank, status, value = item
            if tag != "ready":
                continue
            if status != "ok":
                raise WorkerFailed(
                    f"RPC worker w{rank} failed to start: {value[0]}: {value[1]}\n{value[2]}"
                )
            ready.add(rank)

    # -- tasks

    def submit(self, rank: int, fn: Callable, *args, **kwargs) -> int:
        """Start `fn(*args, **kwargs)` on worker `rank`; returns a task id for `result`."""
        task_id = next(self._ids)
        self._commands[rank].put((task_id, fn, args, kwargs))
        return task_id

    def result(self, task_id: int, timeout: float = 60.0) -> Any:
        """The value of a task; raises WorkerFailed with the worker's traceback if it raised."""
        end = time.monotonic() + timeout
        while task_id not in self._done:
            remaining = end - time.monotonic()
            try:
                tag, rank, status, value = self._results.get(timeout=max(0.05, min(remaining, 1.0)))
            except queue_mod.Empty:
                if remaining <= 0:
                    dead = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
                    raise WorkerFailed(
                        f"Task {task_id} gave no result within {timeout:g}s (dead workers and "
                        f"exit codes: {dead})."
                    ) from None
                continue
            self._done[tag] = (rank, status, value)
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
