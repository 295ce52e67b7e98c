"""deploy/slurm/shoal-train.sbatch submitted to a real Slurm (slurmctld and a slurmd per
network-namespace host, munge; tests/support/slurm_cluster.py): `srun shoal run` takes the node
count, each node's rank and the rendezvous from SLURM_*, the 2-node job trains to the end, and
when a node is lost mid-run (cut off the network, everything on it killed) the other node goes
on alone from the last checkpoint and finishes.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.support.netns import Hosts, require_netns
from tests.support.slurm_cluster import SlurmCluster, require_slurm

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "shoal-train.sbatch"
JOB_TIMEOUT_S = 120
# A short heartbeat so that the survivor's new round does not wait the default time for the
# lost node (the k8s manifests use the same). The last call bounds how far apart srun may start
# the two agents and still have both in round 0 (with --nnodes 1:2 a round completes with one
# node once the last call after the first is over). With 1 s, an agent started 1.5 s after the
# other (as a loaded machine may start srun's two tasks) ran round 0 alone, the late node came
# in by a scale-up (round 1), and the lost node would end round 2, not round 1: the likeliest
# cause of this test's one unexplained failure. A long last call costs nothing when both come:
# a round completes as soon as every node joined, and the survivor's round after a lost node
# waits for no one.
RDZV_CONF = "last_call_timeout=15,heartbeat_interval=1,heartbeat_timeout=6"


@pytest.fixture
def cluster(tmp_path):
    require_netns()
    require_slurm()
    with Hosts(2) as hosts, SlurmCluster(hosts) as slurm:
        yield hosts, slurm


def _submit(slurm: SlurmCluster, tmp_path: Path, steps: int, sleep: float) -> tuple[int, Path]:
    out = tmp_path / "job.out"
    job = slurm.sbatch(
        SBATCH, options=[f"--output={out}", f"--chdir={tmp_path}",
                         # TMPDIR: what a killed node's agent leaves stays in tmp_path.
                         "--export=ALL,NPROC_PER_NODE=1,OMP_NUM_THREADS=1,PYTHONUNBUFFERED=1,"
                         f"SHOAL_CHECKPOINT_DIR={tmp_path / 'ckpt'},TMPDIR={tmp_path}"],
        args=["--rdzv-conf", RDZV_CONF, "-m", "shoal.examples.train_ddp", f"--steps={steps}",
              "--checkpoint-every=10", f"--step-sleep={sleep}"])
    return job, out


def _wait_for_line(out: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        text = out.read_text(errors="replace") if out.exists() else ""
        match = re.search(pattern, text)
        if match:
            return match
        if time.monotonic() > deadline:
            pytest.fail(f"no {pattern!r} in the job's output after {timeout:g}s:\n{text[-3000:]}")
        time.sleep(0.2)


def test_srun_shoal_run_trains_on_two_nodes_from_slurms_variables(cluster, tmp_path):
    hosts, slurm = cluster
    job, out = _submit(slurm, tmp_path, steps=30, sleep=0.0)
    assert slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"},
                                JOB_TIMEOUT_S) == "COMPLETED", out.read_text()[-3000:]
    text = out.read_text()
    assert re.search(r"Round 0 of run \S+ completes with 2 nodes", text), text[-3000:]
    # Both agents joined the same rendezvous, named after the job and step, at the first node.
    assert len(re.findall(rf"joins run slurm-{job}-0\.0 \(c10d \(store\) backend, nodes 1:2",
                          text)) == 2, text[-3000:]
    assert "Rendezvous store listening on n1:" in text
    assert "runs ranks [0] of 2" in text and "runs ranks [1] of 2" in text
    assert re.search(r"\[rank 0\] final step 30 params_sha256 [0-9a-f]{64}", text), text[-3000:]


def test_a_node_lost_mid_run_leaves_the_other_to_finish_from_the_checkpoint(cluster, tmp_path):
    hosts, slurm = cluster
    job, out = _submit(slurm, tmp_path, steps=200, sleep=0.05)
    _wait_for_line(out, r"\[rank 0\] step 30 loss", JOB_TIMEOUT_S)
    hosts.cut(hosts[1])  # n2: off the network, slurmd and the job's processes killed
    state = slurm.wait_for_state(job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"},
                                 JOB_TIMEOUT_S)
    text = out.read_text()
    # Both nodes ran round 0; the survivor met again alone (round 1, one node), resumed from a
    # checkpoint and finished.
    assert re.search(r"Round 0 of run \S+ completes with 2 nodes", text), text[-4000:]
    assert re.search(r"Round 1 of run \S+ completes with 1 nodes", text), text[-4000:]
    assert re.search(r"\[rank 0\] resumed from step \d+", text), text[-4000:]
    assert re.search(r"\[rank 0\] final step 200 params_sha256 [0-9a-f]{64}", text), \
        text[-4000:]
    # Slurm kept the job (--no-kill) and saw the node go down; the job completed.
    assert state == "COMPLETED", (state, text[-3000:])
    assert slurm.node_states().get("n2", "").lower().startswith("down")
