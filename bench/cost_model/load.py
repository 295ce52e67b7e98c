"""Other work's load on this shared machine while a part of the bench runs: runnable tasks
from /proc, less this process's and its descendants' threads."""

from __future__ import annotations

import os
import statistics
import threading
from typing import Optional


class LoadSampler:
    """The average number of runnable tasks that are not this process or its descendants,
    sampled ten times a second while in use (`with LoadSampler() as s: ...; s.background`).

    The machine is shared: other work's runnable tasks take cores from ours just as our own
    ranks do. The model counts only our ranks, so B is printed beside the figures to say how
    far a run can be trusted, not used."""

    INTERVAL_S = 0.1

    def __init__(self):
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5.0)

    @property
    def background(self) -> float:
        # Not clipped sample by sample: the count of runnable tasks and our tasks' states are
        # read a moment apart, so a sample errs either way; the mean does not drift up.
        return max(0.0, statistics.fmean(self._samples)) if self._samples else 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            try:
                self._samples.append(self.sample())
            except OSError:
                pass

    @staticmethod
    def sample() -> int:
        """Runnable tasks now (/proc/loadavg) less ours: the threads in state R of this process
        (the sampler's own thread among them) and of its descendants."""
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            fields = _stat_fields(f"/proc/{entry.name}/stat") if entry.name.isdigit() else None
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
        ours, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            ours += runnable_threads(pid)
            todo.extend(children.get(pid, ()))
        return running - ours


def _stat_fields(path: str) -> Optional[list[str]]:
    """The fields of a /proc stat file after the command name (state first, then the parent),
    or None once the process or thread is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def runnable_threads(pid: int) -> int:
    """Threads of `pid` in state R (a process's own state is only its main thread's)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    states = (_stat_fields(f"/proc/{pid}/task/{tid}/stat") for tid in tasks)
    return sum(1 for fields in states if fields is not None and fields[0] == "R")
