"""`shoal run` on etcd when the rendezvous state's etcd lease is lost mid-job (revoked, or
expired while etcd was away): the state key vanishes with it, and the job must go on with the
restarts it has used so far counted (issue 34: lost leases reset the restart budget). The
running node re-creates the state under the job's generation; a node that never joined (one
waiting for a full round) must not start a new job (a new generation, restart count 0) in the
moment the state is missing."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.support.shoal_run import WORKERS, ShoalRun

pytestmark = pytest.mark.slow

FAIL_ON_FILE = str(WORKERS / "fail_on_file.py")
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"


def _revoke_state_lease(etcd, run_id: str) -> None:
    """Revoke the lease the run's rendezvous state key hangs on (etcd deletes the key)."""
    from shoal.elastic.rendezvous.etcd_client import EtcdClient

    client = EtcdClient([etcd.endpoint], 5.0)
    key = f"/shoal/{run_id}/rdzv/state".encode()
    try:
        async def revoke(c):
            kv = await c.get(key)
            assert kv is not None and kv.lease, f"the state key {key!r} has no lease"
            await c.revoke_lease(kv.lease)

        client.call(revoke, "a lease revocation")
    finally:
        client.close()


def test_a_lost_state_lease_keeps_the_restarts_used(etcd, tmp_path):
    run_id = f"leases-{uuid.uuid4().hex[:8]}"
    fail_file = tmp_path / "fail-now"
    run = ShoalRun(["--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "etcd",
                    "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--rdzv-conf",
                    RDZV_CONF, FAIL_ON_FILE, "--fail-file", str(fail_file), "--max-wait", "90"],
                   name="node")
    with run:
        run.wait_for(r"rank 0 ready", 30)
        fail_file.write_text("")
        run.wait_for(r"Restarting the job \(restart 1 of 3\)", 30)
        fail_file.unlink()
        run.wait_for(r"rank 0 ready", 30, start=run.last_index)
        _revoke_state_lease(etcd, run_id)
        # The node sees its state gone, meets again (no restart spent) and starts its worker.
        run.wait_for(r"vanished", 30, start=run.last_index)
        run.wait_for(r"rank 0 ready", 30, start=run.last_index)
        time.sleep(0.5)
        fail_file.write_text("")
        match = run.wait_for(r"Restarting the job \(restart (\d) of 3\)", 30,
                             start=run.last_index)
        assert match.group(1) == "2", run.tail()
        run.kill()


def _node(etcd, run_id: str, fail_file, name: str) -> ShoalRun:
    return ShoalRun(["--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "3",
                     "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id",
                     run_id, "--rdzv-conf", RDZV_CONF, FAIL_ON_FILE, "--fail-file",
                     str(fail_file), "--max-wait", "90"], name=name)


def test_a_lost_state_lease_with_a_node_waiting_keeps_the_restarts_used(etcd, tmp_path):
    run_id = f"leases-{uuid.uuid4().hex[:8]}"
    fail_file = tmp_path / "fail-now"
    a = _node(etcd, run_id, fail_file, "node A")
    with a:
        a.wait_for(r"rank 0 ready", 30)
        fail_file.write_text("")
        a.wait_for(r"Restarting the job \(restart 1 of 3\)", 30)
        fail_file.unlink()
        a.wait_for(r"rank 0 ready", 30, start=a.last_index)
        b = _node(etcd, run_id, fail_file, "node B")
        with b:
            # B finds the round full (max 1 node) and waits for it to end.
            b.wait_for(r"waits for round \d+ of run \S+ to end before joining", 30)
            _revoke_state_lease(etcd, run_id)
            runs = None
            deadline = time.monotonic() + 30
            while runs is None and time.monotonic() < deadline:
                for node in (a, b):
                    if node.output.count("rank 0 ready") > (2 if node is a else 0):
                        runs = node
                time.sleep(0.1)
            assert runs is not None, a.tail() + "\n" + b.tail()
            time.sleep(0.5)
            fail_file.write_text("")
            match = runs.wait_for(r"Restarting the job \(restart (\d) of 3\)", 30,
                                  start=runs.last_index)
            assert match.group(1) == "2", f"{runs.name}:\n{runs.tail()}\n{a.tail()}"
            b.kill()
        a.kill()
