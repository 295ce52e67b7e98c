"""The loader's worker processes: starting them, talking to them, noticing their death.

One duplex pipe per worker carries small messages (a task's indices one way; a batch's pickle
and its shared-memory layout, an error, or an end-of-stream the other way, a stream's batch or
end with its shard's mark: how many of the shard's items it consumed so far); the batches
themselves cross in shared memory (handover.py). Waits watch the pipes and the processes'
sentinels together, so a worker that dies is reported at once, never waited for.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import pickle
import signal
import time
import weakref
from multiprocessing import connection
from typing import Any, Iterable, Optional

from shoal.core.data import handover
from shoal.core.data.errors import DataLoaderError, DataLoaderTimeout, WorkerDied, WorkerError
from shoal.core.data.worker import WorkerSpec, worker_loop

# The longest a wait sleeps before it looks again (a deadline or a Ctrl-C can cut in).
POLL_S = 0.5
# How long a stopping worker may take to leave before it is killed.
JOIN_S = 5.0
# The same after a failure (a timeout, a dead peer), when waiting longer rarely helps.
FAILED_JOIN_S = 0.5


_live_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_pools() -> None:
    """Stop pools still open at exit (persistent workers, an abandoned loop).

    atexit runs this before multiprocessing's own exit hook, which would SIGTERM the workers
    and leave the slot files of batches in flight in /dev/shm; shutdown stops them in order
    and unlinks those files.
    """
    for pool in list(_live_pools):
        pool.shutdown(grace=FAILED_JOIN_S)


def _context(name: Optional[Any]) -> Any:
    if name is None:
        methods = multiprocessing.get_all_start_methods()
        return multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    if isinstance(name, str):
        return multiprocessing.get_context(name)
    return name


def _how_it_ended(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class Failure:
    """A worker's exception, kept until the loader reaches the batch it belongs to."""

    def __init__(self, worker: int, pid: int, message: tuple) -> None:
        _, _task, exc_type, name, where, text = message
        self.worker, self.pid, self.name, self.where, self.text = worker, pid, name, where, text
        self.exc_type = exc_type

    def exception(self) -> BaseException:
        """The worker's exception type carrying its traceback, or WorkerError if it cannot be."""
        text = (f"Caught {self.name} in DataLoader worker process {self.worker} (pid {self.pid}) "
                f"while {self.where}.\nOriginal {self.text.rstrip()}")
        try:
            cls = pickle.loads(self.exc_type) if self.exc_type is not None else None
            if cls is not None and issubclass(cls, BaseException):
                # torch's ExceptionWrapper.reraise: a KeyError's message is not repr'd, and a
                # type with a `message` field takes the text by that name.
                if cls is KeyError:
                    return cls(_KeyErrorMessage(text))
                if getattr(cls, "message", None):
                    return cls(message=text)
                return cls(text)
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            pass
        return WorkerError(text)


class _KeyErrorMessage(str):
    """A KeyError's text shown as is (KeyError repr()s its argument), as torch's."""

    def __repr__(self) -> str:
        return str(self)


class WorkerPool:
    """`num_workers` processes serving one dataset; batches come back through `receive`."""

    def __init__(self, specs: list[WorkerSpec], prefetch_factor: int, context: Any) -> None:
        if multiprocessing.current_process().daemon:
            raise DataLoaderError(
                f"num_workers={len(specs)} needs child processes, but this process is daemonic "
                f"({multiprocessing.current_process().name}) and multiprocessing forbids a "
                "daemonic process children; use num_workers=0 here")
        ctx = _context(context)
        self.prefetch_factor = prefetch_factor
        self.reader = handover.SlotReader()
        self.conns, self.procs = [], []
        # A worker writes a batch into a slot the main process names; the slot is busy from the
        # task until the batch's arrays are freed (handover.SlotReader), and a worker whose
        # slots are all busy gets a new one. At most prefetch_factor tasks per worker are out.
        self.free_slots: list[list[int]] = [[] for _ in specs]
        self.outstanding = [0] * len(specs)
        self._next_slot = [0] * len(specs)
        self._pending: dict[Any, tuple[int, int]] = {}  # task tag -> (worker, slot)
        self.closed = False
        _live_pools.add(self)
        try:
            for spec in specs:
                ours, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=worker_loop, args=(theirs, spec, os.getpid()),
                                   name=f"shoal-data-worker-{spec.worker_id}", daemon=True)
                proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
        except BaseException:
            self.shutdown()
            raise

    @property
    def size(self) -> int:
        """The number of workers."""
        return len(self.procs)

    def slots_opened(self) -> int:
        """How many slot numbers the workers were handed, in all (a worker maps a file for a
        slot only when a batch above handover.INLINE_BYTES goes into it)."""
        return sum(self._next_slot)

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [p.pid for p in self.procs]

    def submit(self, worker: int, tag: Any, indices: Optional[list]) -> None:
        """Ask `worker` for a batch (of `indices`, or its stream's next) into a free slot."""
        free = self.free_slots[worker]
        if free:
            slot = free.pop()
        else:
            slot = self._next_slot[worker]
            self._next_slot[worker] += 1
        self.outstanding[worker] += 1
        self._pending[tag] = (worker, slot)
        self.send(worker, ("fetch", tag, indices, slot))

    def send(self, worker: int, message: tuple) -> None:
        """Send a control message to one worker."""
        try:
            self.conns[worker].send(message)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            self._raise_dead(worker, "was sent a task", exc)

    def receive(self, deadline: Optional[float], timeout_s: float, waiting_for: str,
                blame: Iterable[int]) -> list[tuple[int, tuple]]:
        """Messages from any worker, as (worker, message); batches already unpacked.

        Raises WorkerDied as soon as a worker's process is gone, and DataLoaderTimeout at the
        deadline (naming `waiting_for` and the workers in `blame`).
        """
        waitables = {c: i for i, c in enumerate(self.conns)}
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                who = ", ".join(f"worker {w} (pid {self.procs[w].pid})" for w in sorted(set(blame)))
                raise DataLoaderTimeout(
                    f"DataLoader timed out after {timeout_s:g} seconds waiting for "
                    f"{waiting_for} from {who or 'its workers'}")
            ready = connection.wait(list(waitables) + list(sentinels), timeout=left)
            out = []
            for obj in ready:
                if obj in waitables:
                    out.extend(self._drain(waitables[obj]))
            if out:
                return out
            for obj in ready:
                if obj in sentinels:
                    self._raise_dead(sentinels[obj], f"was producing {waiting_for}", None)

    def _drain(self, worker: int) -> list[tuple[int, tuple]]:
        conn, out = self.conns[worker], []
        try:
            while conn.poll(0):
                message = conn.recv()
                if message[1] is not None:  # a task's answer
                    _, slot = self._pending.pop(message[1])
                    self.outstanding[worker] -= 1
                    release = functools.partial(self.free_slots[worker].append, slot)
                    if message[0] != "batch":
                        release()
                if message[0] == "batch":
                    _, task, slot, header, path, layout, size, mark = message
                    data = self.reader.unpack(worker, slot, header, path, layout, size, release)
                    message = ("batch", task, slot, data, mark)
                elif message[0] == "error":
                    failure = Failure(worker, self.procs[worker].pid, message)
                    message = ("error", message[1], failure)
                out.append((worker, message))
        except (EOFError, ConnectionResetError, OSError) as exc:
            if not out:
                self._raise_dead(worker, "was sending a batch", exc)
        return out

    def _raise_dead(self, worker: int, doing: str, cause: Optional[BaseException]) -> None:
        proc = self.procs[worker]
        proc.join(1.0)  # the sentinel fires a moment before the exit status is readable
        message = (f"DataLoader worker {worker} (pid {proc.pid}) {_how_it_ended(proc.exitcode)} "
                   f"while it {doing}; a worker that dies cannot be replaced mid-epoch (check "
                   "the dataset for crashes and the machine for the OOM killer)")
        self.shutdown(grace=FAILED_JOIN_S)
        raise WorkerDied(message) from cause

    def shutdown(self, grace: float = JOIN_S) -> None:
        """Stop every worker (killing those that do not leave within `grace`) and unmap slots.

        After a failure the grace is short: a worker stuck in the dataset never reads "stop".
        """
        if self.closed:
            return
        self.closed = True
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_S)
        for conn in self.conns:
            conn.close()
        self.reader.close()
        for proc in self.procs:
            if proc.pid is not None:
                for path in handover.stale_paths(proc.pid):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
