"""Spawning ranks for multi-process tests: module-level targets, child errors sent back to the
parent, bounded joins that fail naming the rank and its exit code, and kill helpers.

Usage:
    results = run_ranks(target, world_size, args=(...), timeout=60)   # list, one per rank
    with Ranks(target, world_size, env=...) as ranks:                # for fault tests
        ranks.wait_ready(...); ranks.kill(2); ranks.results(timeout=...)
`target(rank, world_size, *args)` must be a module-level function; its return value must pickle.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import signal
import time
import traceback
from typing import Any, Callable, Optional

from tests.support import report_pipes

CTX = multiprocessing.get_context("spawn")


class RankFailed(AssertionError):
    """A spawned rank raised, exited early or did not finish in time."""


def _child(target, rank, world_size, args, env, result_pipe, events) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        if events is not None:
            # EVENTS arrives as an unpickled copy, so match by type.
            args = tuple(events if isinstance(a, _EventsMarker) else a for a in args)
        report = ("ok", target(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001  (the parent reports it with the rank)
        report = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
    _send_report(result_pipe, report)


def _send_report(pipe, report) -> None:
    """Write the whole report from this thread before returning: a queue's feeder thread would
    still be writing while the process tears down, and a crash then (a library's thread
    joining itself at exit, say) would leave the parent half a message."""
    report_pipes.write_all(pipe.fileno(), report_pipes.frame(report))
    pipe.close()


class _EventsMarker:
    """Placeholder in `args` replaced by a queue the child may use to talk to the parent."""


EVENTS = _EventsMarker()


def agent_store(world_size: Optional[int] = None):
    """A TCPStore hosted by the test process (as the elastic agent hosts one), and the env that
    lets ranks reach it through init_method="env://"."""
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True, timeout=30,
                     wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "SHOAL_USE_AGENT_STORE": "1"}
    return store, env


class Ranks:
    """`world_size` spawned processes running `target`; a context manager that kills leftovers."""

    def __init__(self, target: Callable, world_size: int, args: tuple = (),
                 env: Optional[dict] = None, rank_env: Optional[dict] = None):
        self.world_size = world_size
        self.events = CTX.Queue()
        self._results: dict[int, tuple] = {}
        self.procs = []
        self._readers: list[report_pipes.Reader] = []
        self._writers = []
        for rank in range(world_size):
            child_env = dict(env or {})
            child_env.update((rank_env or {}).get(rank, {}))
            uses_events = any(a is EVENTS for a in args)
            reader, writer = CTX.Pipe(duplex=False)
            self._readers.append(report_pipes.Reader(reader))
            self._writers.append(writer)
            p = CTX.Process(
                target=_child,
                args=(target, rank, world_size, args, child_env, writer,
                      self.events if uses_events else None),
                name=f"rank{rank}", daemon=True,
            )
            self.procs.append(p)

    def start(self) -> "Ranks":
        for p in self.procs:
            p.start()
        # Only the children may hold a report pipe's writing end, so that a rank's death
        # reads as end-of-file.
        for writer in self._writers:
            writer.close()
        self._writers = []
        return self

    def __enter__(self) -> "Ranks":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to rank `rank`'s process."""
        os.kill(self.procs[rank].pid, sig)

    def event(self, timeout: float) -> Any:
        """The next message a child put on the EVENTS queue (fails early if a rank errs)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.events.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue_mod.Empty:
                pass
            for rank, (status, value) in self._collect(range(self.world_size), 0.0,
                                                        strict=False).items():
                if status != "ok":
                    raise RankFailed(f"Rank {rank} raised while the test waited for an event: {value}")
            if time.monotonic() >= deadline:
                codes = {r: p.exitcode for r, p in enumerate(self.procs)}
                raise RankFailed(f"No event from any rank within {timeout:g}s (exit codes {codes}).")

    def _collect(self, ranks, timeout: float, strict: bool = True) -> dict[int, tuple]:
        """Reports that complete within `timeout` from `ranks` not yet heard from. With
        `strict`, a rank whose pipe closed without a whole report fails the wait, naming it and
        its exit code; without, it is passed over (a fault test may have killed it)."""
        pending = {self._readers[r]: r for r in ranks
                   if r not in self._results and not (self._readers[r].eof and not strict)}
        got = {}
        for reader in report_pipes.ready(pending, timeout):
            rank = pending[reader]
            reader.pump()
            report = reader.take()
            if report is not None:
                self._results[rank] = got[rank] = report
            elif reader.eof and strict:
                self.procs[rank].join(5)
                code = self.procs[rank].exitcode
                if not reader.buffer:
                    raise RankFailed(f"Rank {rank} exited without a result (exit code {code}).")
                raise RankFailed(f"Rank {rank} exited with half its result sent "
                                 f"({len(reader.buffer)} bytes; exit code {code}).")
        return got

    def results(self, timeout: float, ranks=None) -> dict[int, tuple]:
        """Collect ("ok", value) or ("error", (type, message, traceback)) from `ranks`."""
        wanted = set(range(self.world_size) if ranks is None else ranks)
        deadline = time.monotonic() + timeout
        while not wanted <= set(self._results):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - set(self._results))
                codes = {r: self.procs[r].exitcode for r in missing}
                raise RankFailed(
                    f"Ranks {missing} reported nothing within {timeout:g}s (exit codes {codes})."
                )
            self._collect(sorted(wanted), min(left, 0.5))
        return {r: self._results[r] for r in wanted}

    def join(self, timeout: float, ranks=None) -> dict[int, Optional[int]]:
        """Wait for processes to exit; returns rank -> exit code; fails naming stragglers."""
        deadline = time.monotonic() + timeout
        chosen = range(self.world_size) if ranks is None else ranks
        for r in chosen:
            self.procs[r].join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r in chosen if self.procs[r].exitcode is None]
        if stuck:
            raise RankFailed(f"Ranks {stuck} did not exit within {timeout:g}s.")
        return {r: self.procs[r].exitcode for r in chosen}

    def cleanup(self) -> None:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
                p.kill()
        for p in self.procs:
            p.join(5)
        for reader in self._readers:
            reader.close()
        for writer in self._writers:
            writer.close()
        self.events.close()


def run_ranks(target: Callable, world_size: int, args: tuple = (), timeout: float = 60.0,
              env: Optional[dict] = None) -> list:
    """Run `target` on `world_size` spawned ranks; return their results in rank order.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), exited early, hung, or
            exited with a non-zero code.
    """
    with Ranks(target, world_size, args, env) as ranks:
        results = ranks.results(timeout)
        errors = {r: v for r, (s, v) in results.items() if s != "ok"}
        if errors:
            parts = [f"rank {r} raised {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(errors.items())]
            raise RankFailed("\n".join(parts))
        codes = ranks.join(30)
        bad = {r: c for r, c in codes.items() if c != 0}
        if bad:
            raise RankFailed(f"Ranks exited with non-zero codes: {bad}.")
        return [results[r][1] for r in range(world_size)]
