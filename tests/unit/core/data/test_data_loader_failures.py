"""A DataLoader's workers fail loudly and promptly: a killed worker is named with its pid, a
dataset's exception comes back with the worker's traceback, the timeout is honoured, and a
collate of mismatched shapes names the sample and the shapes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shoal.core import data
from shoal.core.data import handover


class Slow(data.Dataset):
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return i


class Broken(data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        return self.decode(i)

    def decode(self, i):
        if i == 5:
            raise ValueError(f"record {i} is corrupt")
        return i


class Ragged(data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        return np.zeros((3, 4 if i != 2 else 5), np.float32)


def test_a_sigkilled_worker_is_named_with_its_pid_within_seconds():
    loader = data.DataLoader(Slow(100, 0.05), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    victim = it.pool.pids()[1]
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(data.WorkerDied,
                       match=rf"DataLoader worker 1 \(pid {victim}\) was killed by signal SIGKILL"):
        for _ in it:
            pass
    assert time.monotonic() - started < 5.0
    assert it.pool.closed  # the surviving worker was stopped too
    assert not any(p.is_alive() for p in it.pool.procs)


def test_a_dataset_exception_is_reraised_with_the_workers_traceback():
    loader = data.DataLoader(Broken(), batch_size=2, num_workers=2)
    with pytest.raises(ValueError) as info:
        list(loader)
    message = str(info.value)
    assert "Caught ValueError in DataLoader worker process 0 (pid " in message
    assert "Original Traceback (most recent call last):" in message
    assert "in decode" in message and "record 5 is corrupt" in message


def test_an_exception_type_that_cannot_be_rebuilt_becomes_a_worker_error():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    class Raises(data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            raise Odd(1, 2)

    with pytest.raises(data.WorkerError, match="Caught Odd in DataLoader worker process 0"):
        list(data.DataLoader(Raises(), num_workers=1))


def test_the_timeout_is_honoured_and_names_the_worker():
    loader = data.DataLoader(Slow(4, 30.0), batch_size=1, num_workers=1, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(data.DataLoaderTimeout,
                       match=r"timed out after 0.5 seconds waiting for batch 0 from worker 0 "
                             r"\(pid \d+\)"):
        next(iter(loader))
    assert 0.5 <= time.monotonic() - started < 8.0  # includes stopping the stuck worker


def test_a_failing_worker_init_fn_is_reported():
    def init(worker_id):
        raise RuntimeError(f"no GPU for worker {worker_id}")

    with pytest.raises(RuntimeError, match=r"(?s)while worker_init_fn.*no GPU for worker 0"):
        list(data.DataLoader(range(4), num_workers=1, worker_init_fn=init))


@pytest.mark.parametrize("workers", [0, 1])
def test_mismatched_shapes_name_the_sample_index_and_shapes(workers):
    loader = data.DataLoader(Ragged(), batch_size=4, num_workers=workers)
    with pytest.raises(data.CollateError,
                       match=r"sample 2 has shape \(3, 5\) where sample 0 has \(3, 4\)"):
        list(loader)


def test_the_timeout_counts_from_the_request_while_other_workers_deliver():
    class OneStuck(data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            if data.get_worker_info().id == 1:
                time.sleep(30)
            time.sleep(0.05)
            return i

    loader = data.DataLoader(OneStuck(), batch_size=1, num_workers=2, timeout=1.0)
    it = iter(loader)
    assert next(it).array.tolist() == [0]
    started = time.monotonic()
    with pytest.raises(data.DataLoaderTimeout, match="waiting for batch 1 from worker 1"):
        next(it)
    assert time.monotonic() - started < 4.0


def test_a_batch_that_cannot_be_pickled_is_reported_not_fatal():
    class Lock(data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            import threading

            return threading.Lock()

    with pytest.raises(TypeError, match=r"(?s)while sending a batch to the main process.*lock"):
        list(data.DataLoader(Lock(), batch_size=None, num_workers=1))


EXIT_WITH_A_LOADER_OPEN = """
import time

import numpy as np
from shoal.core import data

class Big(data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(1 << 17, i, np.float32)

loader = data.DataLoader(Big(), batch_size=2, num_workers=1, persistent_workers=True)
it = iter(loader)
next(it)
print(it.pool.pids()[0], flush=True)
time.sleep(0.5)  # the worker writes the next prefetched batch into a slot nobody maps yet
"""


def test_a_loader_left_open_at_exit_stops_its_workers_and_leaves_no_slot_files():
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_LOADER_OPEN], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert handover.stale_paths(pid) == []


KILLED_WITH_BUSY_WORKERS = """
import os
import sys
import time

from shoal.core import data

busy = sys.argv[1]

class Stuck(data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        if i >= 2:  # inside the dataset, a worker never reaches its idle check on the parent
            open(os.path.join(busy, str(os.getpid())), "w").close()
            time.sleep(600)
        return i

it = iter(data.DataLoader(Stuck(), batch_size=1, num_workers=2))
next(it)
print(*it.pool.pids(), flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its new parent counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_workers_busy_in_the_dataset_die_with_a_sigkilled_main_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WITH_BUSY_WORKERS, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the loader printed no worker pids within 60 s"
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        deadline = time.monotonic() + 30
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(int(p) for p in os.listdir(tmp_path)) == sorted(workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 3.0  # PR_SET_PDEATHSIG acts at once; allow scheduling
        while not all(gone(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in workers if not gone(p)] == []
    finally:
        proc.kill()
        proc.wait(10)
        for pid in workers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
