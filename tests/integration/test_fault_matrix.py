"""The fault matrix: real `shoal run` jobs of examples/train_ddp.py, each hurt at one placement,
each asserting recovery with exactly the parameters of an uninterrupted run, or a clear error.

Placements (workers/fault_at.py installs the hook, then runs the example):
- SIGKILL of rank 1 in the middle of the gradient bucket's all_reduce over sockets, Unix and
  TCP, through the direct exchange (a 22 KB bucket) and through the ring (a 77 KB bucket);
- SIGKILL inside the shared-memory all_reduce, after publishing, before the barrier;
- SIGKILL in the middle of backward (the middle node of the step's autograd graph);
- SIGKILL inside a checkpoint save (workers/kill_in_save.py, between fsync and rename);
- SIGSTOP of rank 1 with --collective-timeout 5: a peer times out naming it, and the agent
  blames it;
- SIGKILL of the agent of the node that does not host the embedded store (--nnodes 1:2): the
  other node goes on alone.

Each faulted job's reference is an uninterrupted run through the same wrapper with the same
world size, model, transport and steps (the ring and shared-memory algorithms round in other
orders than the direct exchange, so a reference is kept per combination). Those rows once
exposed a resume bug: DDP rebuilt its buckets after each process's first round, so the first
round after a resume reduced in another layout than the uninterrupted run did; the reducer now
reduces its first round in the rebuilt layout.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from typing import Optional

import pytest

from tests.support.shoal_run import WORKERS, ShoalRun, check_resume, final_sha, pid_alive

pytestmark = pytest.mark.slow

STEPS, EVERY, FAULT_STEP = 30, 5, 12
TRAIN_ARGS = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
FAULT_AT = str(WORKERS / "fault_at.py")
KILL_IN_SAVE = str(WORKERS / "kill_in_save.py")
JOB_TIMEOUT = 60
# A bucket of this hidden width is 76816 bytes: past the 64 KiB small-message size, so it
# takes the ring over sockets and the shared-memory path under SHOAL_LOCAL_TRANSPORT=shm.
WIDE = 128
# Short heartbeats so a dead agent is noticed in about 2 s.
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"

@dataclasses.dataclass(frozen=True)
class Placement:
    """One row of the matrix: how the job runs and what the hurt rank must print."""

    fault: str  # fault_at.py's --fault, or "save" (kill_in_save.py) or "agent"
    transport: str = "shm"  # SHOAL_LOCAL_TRANSPORT
    hidden: Optional[int] = None
    fraction: float = 0.5
    fault_line: str = ""  # a regex for the hurt rank's own line
    victim: int = 1
    resumed: int = 10  # the checkpoint the restarted job must load

    def worker(self) -> list[str]:
        """The script and its arguments."""
        if self.fault == "save":
            return [KILL_IN_SAVE, *TRAIN_ARGS, "--kill-at-save", "10"]
        args = [FAULT_AT, "--fault", "none" if self.fault == "agent" else self.fault,
                "--fault-step", str(FAULT_STEP), "--fault-rank", str(self.victim),
                "--fault-fraction", str(self.fraction)]
        return args + (["--hidden", str(self.hidden)] if self.hidden else []) + TRAIN_ARGS


def _sockets(transport: str, hidden: Optional[int], fraction: float) -> Placement:
    family = {"unix": "Unix", "tcp": "TCP"}[transport]
    total = 76816 if hidden else 22032
    return Placement(
        "sockets", transport, hidden, fraction,
        rf"\[rank 1\] killing rank 1 in the all_reduce of step {FAULT_STEP} over {family} "
        rf"sockets after sending {int(fraction * total)} bytes \({fraction:g} times its "
        rf"{total}-byte gradient bucket\)$",
    )


PLACEMENTS = [
    # Direct exchange: rank 0 gets all of rank 1's bucket, rank 2 half of it, rank 3 nothing.
    pytest.param(_sockets("unix", None, 1.5), id="allreduce-unix-direct"),
    pytest.param(_sockets("tcp", None, 1.5), id="allreduce-tcp-direct"),
    # Ring: rank 1 dies halfway through the reduce-scatter.
    pytest.param(_sockets("unix", WIDE, 0.5), id="allreduce-unix-ring"),
    pytest.param(_sockets("tcp", WIDE, 0.5), id="allreduce-tcp-ring"),
    pytest.param(Placement(
        "shm", "shm", WIDE, fault_line=rf"\[rank 1\] killing rank 1 in the shared-memory "
        rf"all_reduce of step {FAULT_STEP}: its chunk is published, the barrier not reached$"),
        id="allreduce-shm"),
    pytest.param(Placement(
        "backward", fault_line=rf"\[rank 1\] killing rank 1 in the backward of step "
        rf"{FAULT_STEP} at node \d+ of \d+ \(\w+Backward\)$"), id="backward"),
    pytest.param(Placement(
        "save", victim=0, resumed=5,
        fault_line=r"\[rank 0\] killing rank 0 inside the save of step 10$"),
        id="checkpoint-write"),
    pytest.param(Placement(
        "stop", fault_line=rf"\[rank 1\] stopping rank 1 at the start of step {FAULT_STEP} "
        r"\(pid \d+\)$"), id="sigstop-collective-timeout"),
    pytest.param(Placement("agent"), id="agent-kill-2-nodes"),
]


def _env(placement: Placement, tmp_path) -> dict:
    return {"SHOAL_LOCAL_TRANSPORT": placement.transport, "SHOAL_DUMP_DIR": str(tmp_path)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """reference(placement) -> params_sha256 of an uninterrupted 4-rank run of the placement's
    model over its transport without the fault, run once per module."""
    cache: dict = {}

    def launch(clean: Placement, tmp) -> ShoalRun:
        args = ["--standalone", "--nproc-per-node", "4", "--checkpoint-dir", str(tmp / "ck"),
                *clean.worker()]
        with ShoalRun(args, env=_env(clean, tmp), name="reference") as run:
            assert run.wait(JOB_TIMEOUT) == 0, run.tail()
        assert "Restarting the job" not in run.output, run.tail()
        return run

    def get(placement: Placement) -> str:
        key = (placement.hidden, placement.transport)
        if key not in cache:
            clean = dataclasses.replace(placement, fault="none")
            cache[key] = final_sha(launch(clean, tmp_path_factory.mktemp("reference")), STEPS)
        return cache[key]

    return get


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_fault_matrix(placement, tmp_path, reference):
    if placement.fault == "agent":
        return _agent_kill(placement, tmp_path)
    args = ["--standalone", "--nproc-per-node", "4", "--max-restarts", "1",
            "--checkpoint-dir", str(tmp_path / "ck")]
    if placement.fault == "stop":
        args += ["--collective-timeout", "5"]
    with ShoalRun(args + placement.worker(), env=_env(placement, tmp_path), name="job") as run:
        pids = run.worker_pids(JOB_TIMEOUT)
        run.wait_for(placement.fault_line, JOB_TIMEOUT)
        assert run.wait(JOB_TIMEOUT) == 0, run.tail()
    victim_pid = pids[placement.victim]
    if placement.fault == "stop":
        # The agent continues the stopped worker after SIGTERM, so it dies at once instead of
        # costing the whole grace period.
        assert "outlived the" not in run.output, run.tail()
        # A peer's collective times out naming the stopped rank, and the agent blames it (not
        # the rank that noticed) in the round's error and the restart's reason.
        v = placement.victim
        timeout = (rf"Rank (\d) timed out after 5s in all_reduce #\d+ of group 'default': "
                   rf"rank {v} never arrived")
        assert re.search(rf"\[rank \d\] {timeout}", run.output), run.tail()
        blame = re.search(rf"ERROR Round 0: rank {v} hung: {timeout}\..* \(rank (\d) noticed "
                          r"and ended with exit code 75\)\. Watchdog dump: (\S+)$", run.output,
                          re.M)
        # Which peer's watchdog fires first is a race; the agent names as the one that noticed
        # the peer whose timeout it quotes (its dump is where the blame comes from).
        assert blame and v != int(blame.group(1)) == int(blame.group(2)), run.tail()
        # the dump named is the noticing rank's own, and it exists
        assert f"-rank{blame.group(2)}-" in blame.group(3) and os.path.exists(blame.group(3))
        assert re.search(rf"rank {v} hung: rank \d on node \S+ timed out waiting for it",
                         run.output), run.tail()
    else:
        assert (f"ERROR Round 0: rank {placement.victim} (local rank {placement.victim}, pid "
                f"{victim_pid}) ended with signal SIGKILL (exit code -9)") in run.output
    assert "Restarting the job (restart 1 of 1)" in run.output, run.tail()
    assert "runs ranks [0, 1, 2, 3] of 4 (restart 1)" in run.output, run.tail()
    assert not any(pid_alive(p) for p in pids)
    assert check_resume(run, 1, STEPS, EVERY) == placement.resumed
    assert final_sha(run, STEPS) == reference(placement), run.tail()


def _agent_kill(placement: Placement, tmp_path) -> None:
    """Two nodes of 2 ranks on the embedded store (node A hosts it); node B's agent is
    SIGKILLed with its workers mid-run. Node A must re-rendezvous alone and finish."""
    run_id = f"matrix-{uuid.uuid4().hex[:8]}"
    base = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1",
            "--rdzv-id", run_id, "--rdzv-conf", RDZV_CONF,
            "--checkpoint-dir", str(tmp_path / "ck")]
    worker = placement.worker() + ["--step-sleep", "0.1"]
    env = {**_env(placement, tmp_path), "SHOAL_AUTH_TOKEN": uuid.uuid4().hex * 2}  # one secret
    with ShoalRun(base + ["--rdzv-endpoint", "127.0.0.1:0", "--node-rank", "0"] + worker,
                  env=env, name="node A") as a:
        endpoint = f"127.0.0.1:{a.store_port()}"
        with ShoalRun(base + ["--rdzv-endpoint", endpoint, "--node-rank", "1"] + worker,
                      env=env, name="node B") as b:
            a.wait_for(r"runs ranks \[0, 1\] of 4 \(restart 0\)", JOB_TIMEOUT)
            # Past the first checkpoint (step 5) of the 2-node round:
            a.wait_for(r"\[rank 0\] step 8 ", JOB_TIMEOUT, start=a.last_index)
            b_workers = b.worker_pids(5)
            b_id = b.wait_for(r"Node (\S+) joins run", 5).group(1)
            # The resume to check is the one after the kill: on a loaded machine node A may
            # have formed round 0 alone and resumed once already when B joined (a scale-up).
            killed_at = len(a.lines())
            b.kill()  # SIGKILL the agent's process group: the agent and its workers
            assert a.wait(JOB_TIMEOUT) == 0, a.tail()
    assert not any(pid_alive(p) for p in b_workers)
    assert f"node {b_id} sent no heartbeat for " in a.output, a.tail()
    assert re.search(r"INFO Round [1-9]\d*: node rank 0 of 1 runs ranks \[0, 1\] of 2 "
                     r"\(restart 0\)", a.output), a.tail()
    assert "Restarting the job" not in a.output  # a lost node costs no restart
    resumed = check_resume(a, 0, STEPS, EVERY, start=killed_at)
    assert resumed >= 5, resumed
    final_sha(a, STEPS)
