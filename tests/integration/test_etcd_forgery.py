"""An etcd writer against a running two-node `shoal run` job on a real etcd.

Whoever can write to etcd may stop a job, never steer it or make it report success: a forged
`"closed": true` in the rendezvous state (issue 34: both nodes exited 0 at step 15 of 60) ends
both nodes with a non-zero status naming the forged key, and a forged master store address for
the next round is refused (no worker ever connects to it) rather than followed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid

import pytest

from tests.support.shoal_run import TRAIN_DDP, ShoalRun

pytestmark = pytest.mark.slow

SECRET = "forgery-" + uuid.uuid4().hex
STEPS = 60
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"
JOB_TIMEOUT = 90


def _pair(etcd, tmp_path, run_id: str):
    base = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", RDZV_CONF, "--checkpoint-dir", str(tmp_path / "checkpoints")]
    worker = [str(TRAIN_DDP), "--steps", str(STEPS), "--checkpoint-every", "5",
              "--step-sleep", "0.1"]
    env = {"SHOAL_AUTH_TOKEN": SECRET}
    return (ShoalRun(base + ["--node-rank", "0"] + worker, env=env, name="node A"),
            ShoalRun(base + ["--node-rank", "1"] + worker, env=env, name="node B"))


def _run_keys(etcd, run_id: str):
    """A raw etcd client on the run's keys, as an attacker with etcd write access has."""
    from shoal.elastic.rendezvous.etcd_store import EtcdStore

    return EtcdStore(etcd.endpoint, prefix=f"/shoal/{run_id}/", timeout=5)


def test_a_forged_close_ends_both_nodes_non_zero_naming_the_forgery(etcd, tmp_path):
    run_id = f"forged-close-{uuid.uuid4().hex[:8]}"
    a, b = _pair(etcd, tmp_path, run_id)
    keys = _run_keys(etcd, run_id)
    with a, b, keys:
        a.wait_for(r"\[rank 0\] step 15 ", JOB_TIMEOUT)
        state = json.loads(keys.get("rdzv/state", 5))
        state["closed"] = True  # the one write of the issue (a MAC, if any, left as it was)
        keys.set("rdzv/state", json.dumps(state, sort_keys=True, separators=(",", ":")))
        codes = (a.wait(JOB_TIMEOUT), b.wait(JOB_TIMEOUT))
    key = f"etcd key '/shoal/{run_id}/rdzv/state'"
    for run, code in zip((a, b), codes):
        assert code != 0, f"{run.name} reported success with the work undone:\n{run.tail()}"
        assert f"The rendezvous state at {key} fails its MAC" in run.output, run.tail()
    assert f"[rank 0] step {STEPS} " not in a.output


class _Trap:
    """A listener at the forged master address that counts who connects to it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _forge_master_addresses(keys, run_id: str, address: str, stop: threading.Event) -> None:
    """Keep the master address of the current and the next round forged."""
    while not stop.is_set():
        try:
            state = json.loads(keys.get("rdzv/state", 2))
            for round_ in (state["round"], state["round"] + 1):
                keys.set(f"store/rdzv/{run_id}/{state['generation']}/round_{round_}/"
                         "master_addr_port", address)
        except Exception:  # noqa: BLE001  (best effort: the state may be between writes)
            pass
        stop.wait(0.02)


def test_a_forged_master_address_is_never_followed(etcd, tmp_path):
    run_id = f"forged-master-{uuid.uuid4().hex[:8]}"
    a, b = _pair(etcd, tmp_path, run_id)
    trap = _Trap()
    keys = _run_keys(etcd, run_id)
    stop = threading.Event()
    forger = threading.Thread(target=_forge_master_addresses,
                              args=(keys, run_id, f"127.0.0.1:{trap.port}", stop), daemon=True)
    try:
        with a, b, keys:
            a.wait_for(r"\[rank 0\] step 8 ", JOB_TIMEOUT)
            forger.start()
            time.sleep(0.5)  # the next round's key is forged before the restart below
            os.kill(b.worker_pids(5)[0], signal.SIGKILL)  # round 1 reads the address again
            code_b = b.wait(JOB_TIMEOUT)
            if code_b != 0:
                a.kill()  # node B stopped, so node A has nobody left to train with
            code_a = a.wait(JOB_TIMEOUT)
    finally:
        stop.set()
        if forger.is_alive():
            forger.join(5)
        trap.close()
    assert trap.connections == 0, f"a node followed the forged address:\n{b.tail()}"
    if code_b == 0:  # node B read the genuine address before the forger overwrote it
        assert code_a == 0 and f"[rank 0] step {STEPS} " in a.output, a.tail()
    else:
        assert "master_addr_port' fails its MAC" in b.output, b.tail()
