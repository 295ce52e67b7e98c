"""A new job under a run id an earlier job used, on a real etcd.

A job that finished cleanly leaves no store keys behind, and while its closed rendezvous is
still stored a new node is refused with a sentence that says why and what to do. A job whose
agents were killed leaves its keys (restart count, round endings) in etcd; once its state
expired (the lease ttl after its last node), a new job under its run id starts clean anyway:
restart count 0 and rounds of its own.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.shoal_run import ShoalRun, WORKERS

SECRET = "stale-" + uuid.uuid4().hex
ENV_WORKER = str(WORKERS / "env_worker.py")


@pytest.fixture
def etcd():
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.close()


def _job(etcd, run_id, *worker_args):
    return ShoalRun(["--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoint}",
                     f"--rdzv-id={run_id}", "--rdzv-conf=ttl=2,last_call_timeout=0",
                     "--nproc-per-node=2", "--max-restarts=3", ENV_WORKER, *worker_args],
                    env={"SHOAL_AUTH_TOKEN": SECRET})


def _restart_counts(output: str) -> list[str]:
    return sorted({json.loads(m.group(1))["SHOAL_RESTART_COUNT"]
                   for m in re.finditer(r"ENV (\{.*\})", output)})


def _store_keys(etcd, run_id) -> int:
    from shoal.elastic.rendezvous.etcd_store import EtcdStore

    store = EtcdStore(etcd.endpoint, prefix=f"/shoal/{run_id}/store/", timeout=5)
    try:
        return store.num_keys()
    finally:
        store.close()


def _state_gone(etcd, run_id, timeout=20.0) -> None:
    from shoal.elastic.rendezvous.etcd_backend import EtcdRendezvousBackend

    backend = EtcdRendezvousBackend(etcd.endpoint, run_id, ttl=2, timeout=5)
    try:
        deadline = time.monotonic() + timeout
        while backend.get_state() is not None:
            assert time.monotonic() < deadline, "the old job's rendezvous state never expired"
            time.sleep(0.2)
    finally:
        backend.close()


def test_a_finished_run_leaves_no_keys_and_its_id_is_refused_while_closed(etcd):
    run_id = "finished-" + uuid.uuid4().hex[:6]
    with _job(etcd, run_id, "--fail-rank=0", "--fail-attempts=1") as first:
        assert first.wait(60) == 0, first.tail()
    assert _restart_counts(first.output) == ["0", "1"]
    assert "removed the" in first.output and _store_keys(etcd, run_id) == 0
    # At once: the closed rendezvous is still there; a new node is told why it cannot join.
    with _job(etcd, run_id) as early:
        assert early.wait(60) == 1, early.tail()
    assert (f"run id '{run_id}' belongs to a job that already ended (its rendezvous is closed)"
            in early.output), early.tail()
    assert "own --rdzv-id" in early.output


def test_a_killed_runs_keys_do_not_leak_into_the_next_job_under_its_id(etcd):
    run_id = "killed-" + uuid.uuid4().hex[:6]
    first = _job(etcd, run_id, "--fail-rank=0", "--fail-attempts=1", "--wait=60")
    with first:
        first.wait_for(r"rank [01] ready", 60)
        first.wait_for(r"Restarting the job \(restart 1 of 3\)", 60)
        first.wait_for(r'"SHOAL_RESTART_COUNT": "1"', 60)
    # SIGKILLed (the context manager's exit): nothing was cleaned up.
    assert _store_keys(etcd, run_id) > 0
    _state_gone(etcd, run_id)
    with _job(etcd, run_id, "--fail-rank=1", "--fail-attempts=1") as second:
        assert second.wait(60) == 0, second.tail()
    assert _restart_counts(second.output) == ["0", "1"], second.tail()
    assert "already ended by another node" not in second.output
    assert "Restarting the job (restart 1 of 3)" in second.output
