"""Real `shoal run` jobs while strangers flood the rendezvous store: 500 idle connections held
while a second node joins, garbage connections throughout, and a job under a low `ulimit -n`.
The job must form, train and finish; a right-secret client must be served during the flood;
the agent's log must summarise the rejections instead of printing one line per connection."""

from __future__ import annotations

import random
import re
import resource
import socket
import threading
import time
import uuid

import pytest

from shoal.collectives.store.tcp import TCPStore
from tests.support.shoal_run import TRAIN_DDP, ShoalRun

pytestmark = pytest.mark.slow

SECRET = "flood-test-" + uuid.uuid4().hex
STEPS = 30
TRAIN = [str(TRAIN_DDP), "--steps", str(STEPS), "--checkpoint-every", "10",
         "--step-sleep", "0.05"]
FINAL = re.compile(rf"\[rank 0\] final step {STEPS} params_sha256 [0-9a-f]{{64}}")
JOB_TIMEOUT = 90


class Flood:
    """Idle connections held open, plus a thread sending garbage connections (bounded)."""

    def __init__(self, port: int, idle: int, garbage: int = 0):
        self.port = port
        self.idle: list[socket.socket] = []
        for _ in range(idle):
            self.idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        self._stop = threading.Event()
        self._garbage = threading.Thread(target=self._send_garbage, args=(garbage,), daemon=True)
        self._garbage.start()

    def _send_garbage(self, count: int) -> None:
        rng = random.Random(0)
        for _ in range(count):
            if self._stop.is_set():
                return
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                    sock.sendall(rng.randbytes(rng.randrange(1, 200)))
            except OSError:
                pass
            time.sleep(0.002)

    def release(self) -> None:
        self._stop.set()
        self._garbage.join(10)
        for sock in self.idle:
            sock.close()
        self.idle.clear()


def _served(port: int) -> float:
    """A right-secret store client joins the rendezvous store; return how long it took."""
    start = time.monotonic()
    with TCPStore("127.0.0.1", port, timeout=10, token=SECRET) as store:
        store.check(["anything"])
    return time.monotonic() - start


def _rejection_lines(run: ShoalRun) -> list[str]:
    return [line for line in run.lines() if "turned away" in line]


def test_a_second_node_joins_and_the_job_finishes_while_500_idle_connections_are_held(tmp_path):
    run_id = f"flood-{uuid.uuid4().hex[:8]}"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
              "--rdzv-id", run_id, "--checkpoint-dir", str(tmp_path / "ck")]
    env = {"SHOAL_AUTH_TOKEN": SECRET}
    with ShoalRun(common + ["--rdzv-endpoint", "127.0.0.1:0", "--node-rank", "0"] + TRAIN,
                  env=env, name="node A") as a:
        port = a.store_port()
        flood = Flood(port, idle=500, garbage=2000)
        try:
            assert _served(port) < 2.0
            with ShoalRun(common + ["--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", "1"]
                          + TRAIN, env=env, name="node B") as b:
                assert _served(port) < 2.0  # also while the job trains
                assert a.wait(JOB_TIMEOUT) == 0, a.tail()
                assert b.wait(JOB_TIMEOUT) == 0, b.tail()
        finally:
            flood.release()
    assert FINAL.search(a.output), a.tail()
    # Thousands of strangers, a handful of lines: one at once, then one summary per interval.
    lines = _rejection_lines(a)
    assert 1 <= len(lines) <= 12, lines
    assert not [line for line in a.lines() if "check that every process uses the same" in line]


def test_a_job_under_a_low_descriptor_limit_survives_a_flood_and_every_port_accepts_again(
        tmp_path):
    env = {"SHOAL_AUTH_TOKEN": SECRET}
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "--checkpoint-dir", str(tmp_path / "ck")] + TRAIN
    with ShoalRun(args, env=env, name="job") as run:
        # The agent (and the workers it starts, which inherit the limit) get few descriptors.
        resource.prlimit(run.proc.pid, resource.RLIMIT_NOFILE, (192, 192))
        port = run.store_port()
        flood = Flood(port, idle=600, garbage=500)
        try:
            assert _served(port) < 2.0
            run.wait_for(r"\[rank 0\] step 10 ", JOB_TIMEOUT)
        finally:
            flood.release()
        assert _served(port) < 2.0  # accepting again once the strangers left
        assert run.wait(JOB_TIMEOUT) == 0, run.tail()  # no restart was used up
    assert FINAL.search(run.output), run.tail()
