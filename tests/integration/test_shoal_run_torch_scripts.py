"""Unchanged PyTorch scripts under `shoal run`, one per torchrun line the README claims.

Each worker is plain torch: `init_process_group("gloo")` over env://, so torch's C++ TCPStore
client dials MASTER_ADDR:MASTER_PORT, the agent's store door (elastic/agent/store_door.py),
which speaks torch's protocol to it. The failure tests use torch's own `@record`: its
exception must reach the agent's log, the failure summary and the agent's own error file (the
Kubernetes termination message).
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid

import pytest

from tests.support.requirements import missing
from tests.support.shoal_run import ROOT, WORKERS, ShoalRun


@pytest.fixture(autouse=True)
def _torch_installed():
    if importlib.util.find_spec("torch") is None:
        missing("the torch-script tests", "torch is not installed (pip install torch==2.13.0)")


DDP = str(ROOT / "examples" / "torch" / "ddp.py")
FSDP2 = str(ROOT / "examples" / "torch" / "fsdp2.py")
FAIL = str(WORKERS / "torch_record_fail.py")
TIMEOUT = 100  # two torch imports on a shared 2-core machine take seconds each, not minutes
# Measured 6-25 s per test on a shared 2-core machine; two agents wait one after the other.
pytestmark = pytest.mark.timeout(240)
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=3,last_call_timeout=0.5"
SECRET = "torch-scripts-" + uuid.uuid4().hex  # one job secret for every agent of a test


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "SHOAL_RDZV"))}
    env.update(SHOAL_AUTH_TOKEN=SECRET, OMP_NUM_THREADS="1",
               **extra)
    return env


def _finish(*runs: ShoalRun) -> None:
    for run in runs:
        assert run.wait(TIMEOUT) == 0, run.tail()


def test_standalone_runs_the_torch_ddp_example():
    with ShoalRun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", DDP,
                   "--steps", "3"], env=_env(), name="standalone") as run:
        _finish(run)
    assert "ddp done: 2 ranks, 3 steps, backend gloo" in run.output, run.tail()


def test_c10d_runs_the_torch_fsdp2_example():
    with ShoalRun(["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--nnodes", "1",
                   "--nproc-per-node", "2", "--max-restarts", "0", FSDP2, "--steps", "3"],
                  env=_env(), name="c10d") as run:
        _finish(run)
    assert "fsdp2 done: 2 ranks, 3 steps, backend gloo" in run.output, run.tail()


def test_static_rendezvous_with_two_agents_runs_torch_ddp():
    # --master-port 0 (no fixed port in tests) makes node 0's run id private: both name it.
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--max-restarts", "0", "--rdzv-id", f"static-{uuid.uuid4().hex[:8]}"]
    with ShoalRun(common + ["--node-rank", "0", "--master-port", "0", DDP, "--steps", "3"],
                  env=_env(), name="node 0") as first:
        port = first.store_port()
        with ShoalRun(common + ["--node-rank", "1", "--master-port", str(port), DDP,
                                "--steps", "3"], env=_env(), name="node 1") as second:
            _finish(first, second)
    assert "ddp done: 2 ranks, 3 steps" in first.output, first.tail()


def test_etcd_rendezvous_with_two_agents_runs_torch_ddp(shared_etcd):
    common = ["--rdzv-backend", "etcd", "--rdzv-endpoint", shared_etcd.endpoint,
              "--rdzv-id", f"torch-{uuid.uuid4().hex[:8]}", "--rdzv-conf", RDZV_CONF,
              "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0", DDP,
              "--steps", "3"]
    with ShoalRun(common, env=_env(), name="node A") as a, \
            ShoalRun(common, env=_env(), name="node B") as b:
        _finish(a, b)
    assert "ddp done: 2 ranks, 3 steps" in a.output + b.output, a.tail() + b.tail()


def test_elastic_nnodes_restarts_a_torch_job_and_logs_the_record_root_cause():
    with ShoalRun(["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf",
                   RDZV_CONF, "--nproc-per-node", "2", "--max-restarts", "2", FAIL,
                   "--fail-rank", "1", "--fail-attempts", "1"], env=_env(),
                  name="elastic") as run:
        _finish(run)
    out = run.output
    # torch's @record wrote the exception into the folder the agent made; the agent read it.
    assert "its error: ValueError: rank 1 found a bad batch on attempt 0" in out, run.tail()
    assert "Restarting the job (restart 1 of 2)" in out, run.tail()
    assert "torch worker 0 of 2 done on attempt 1" in out, run.tail()
    assert "FileNotFoundError" not in out, run.tail()


def test_exhausted_restarts_show_the_record_root_cause_in_summary_and_termination_message(
        tmp_path):
    termination = tmp_path / "termination-log"
    with ShoalRun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", FAIL,
                   "--fail-rank", "0", "--fail-attempts", "9"],
                  env=_env(TORCHELASTIC_ERROR_FILE=str(termination)), name="failing") as run:
        assert run.wait(TIMEOUT) == 1, run.tail()
    summary = run.output[run.output.index("shoal run: job "):]
    assert "failed after 1 restart(s)" in summary, run.tail()
    assert "Its error: ValueError: rank 0 found a bad batch on attempt 1" in summary, run.tail()
    doc = json.loads(termination.read_text())
    assert doc["message"]["message"] == "ValueError: rank 0 found a bad batch on attempt 1"
    # torch's own traceback of the exception, as @record captured it in the worker.
    assert "torch_record_fail.py" in doc["message"]["extraInfo"]["py_callstack"]
