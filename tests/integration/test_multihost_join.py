"""A host that joins a running multi-host job is admitted at the next rendezvous round.

Two network-namespace hosts (tests/support/netns.py) train examples/train_ddp.py with one rank
each under `--nnodes 2:3`, against a real etcd on the first host and one shared checkpoint
directory (as shared storage would be). Once training is past its first checkpoint a third host
starts its agent. The running agents must notice the waiting node, end the round without
costing a restart, and restart their workers at world size 3 from the last checkpoint, with the
new host's worker taking part; the job must end with exactly the parameters of the same
world-size schedule run without interruption on one host (2 ranks to the resumed step k, then
3 ranks to the end).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.netns import Hosts, require_netns
from tests.support.shoal_run import (
    ROOT,
    TRAIN_DDP,
    FollowedProcess,
    ShoalRun,
    digest_in,
    final_sha,
    steps_run,
)

pytestmark = pytest.mark.slow

STEPS, EVERY = 40, 4
# Slow enough that the late agent (a few seconds to start inside its namespace on a busy
# 2-core machine) arrives well before the job's end.
STEP_SLEEP = 0.3
JOB_TIMEOUT = 75
SECRET = "multihost-join-" + uuid.uuid4().hex
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"


def _start_agent(host, etcd, run_id, tmp_path, job) -> FollowedProcess:
    # --node-rank fixes where rank 0 (the one that prints) runs: on the first host, every round.
    argv = [sys.executable, "-m", "shoal.launcher", "run", "--nnodes", "2:3",
            "--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", RDZV_CONF, "--max-restarts", "1",
            "--node-rank", str(host.index), "--checkpoint-dir", str(tmp_path / f"ck-{host.index}"),
            *job]
    env = {**os.environ, "SHOAL_AUTH_TOKEN": SECRET}
    proc = host.popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True, errors="replace")
    return FollowedProcess(proc, f"host {host.index}")


def _reference_sha(tmp_path, resumed: int) -> str:
    """The same schedule without interruption, on one host over sockets as across hosts."""
    env = {"SHOAL_AUTH_TOKEN": SECRET, "SHOAL_LOCAL_TRANSPORT": "unix"}
    ck = tmp_path / "reference"
    job = [str(TRAIN_DDP), "--checkpoint-every", str(EVERY), "--checkpoint-dir", str(ck)]
    for nproc, until in ((2, resumed), (3, STEPS)):
        with ShoalRun(["--standalone", "--nproc-per-node", str(nproc), *job, "--steps",
                       str(until)], env=env, name=f"reference W={nproc}") as run:
            assert run.wait(JOB_TIMEOUT) == 0, run.tail()
    return final_sha(run, STEPS)


@pytest.mark.timeout(240)
def test_a_host_joining_late_is_admitted_at_the_next_round(tmp_path):
    require_netns()
    job = [str(TRAIN_DDP), "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
           "--step-sleep", str(STEP_SLEEP), "--checkpoint-dir", str(tmp_path / "shared")]
    run_id = f"mh-join-{uuid.uuid4().hex[:8]}"
    with Hosts(3) as hosts:
        etcd = EtcdServer(host=hosts[0].address, command_prefix=hosts[0].command([]))
        try:
            etcd.start()
            first, second = (_start_agent(h, etcd, run_id, tmp_path, job) for h in hosts[:2])
            first.wait_for(r"runs ranks \[0\] of 2 \(restart 0\)", JOB_TIMEOUT)
            # Past the first checkpoint (step 4) of the two-host round, well before the end.
            first.wait_for(r"\[rank 0\] step 5 ", JOB_TIMEOUT)
            late = _start_agent(hosts[2], etcd, run_id, tmp_path, job)
            agents = (first, second, late)
            codes = [agent.wait(JOB_TIMEOUT) for agent in agents]
        finally:
            etcd.close()
    for agent, code in zip(agents, codes):
        assert code == 0, f"{agent.name} exited with {code}:\n{agent.tail()}"

    out = first.output
    assert "a node is waiting to join: scaling up" in first.output + second.output, out
    # The running agents restarted their workers at world size 3, without costing a restart ...
    assert re.search(r"runs ranks \[0\] of 3 \(restart 0\)", out), out
    assert re.search(r"runs ranks \[1\] of 3 \(restart 0\)", second.output), second.tail()
    # ... and the new host's worker took part, as rank 2 of 3 (its only round).
    assert re.search(r"runs ranks \[2\] of 3 \(restart 0\)", late.output), late.tail()
    assert "[rank 2] rank 2 of 3 (local rank 0), restart 0" in late.output, late.tail()
    assert "of 2" not in "\n".join(ln for ln in late.lines() if "runs ranks" in ln), late.tail()

    # Resumed once, from a checkpoint of the two-host round, then every later step exactly once.
    lines = first.lines()
    resumes = [(i, int(m.group(1))) for i, line in enumerate(lines)
               if (m := re.search(r"\[rank 0\] resumed from step (\d+) \(restart 0\)", line))]
    assert len(resumes) == 1, out
    index, resumed = resumes[0]
    before, after = steps_run(lines[:index]), steps_run(lines[index:])
    assert resumed % EVERY == 0 and EVERY <= resumed <= max(before) < STEPS, (resumed, before)
    assert after == list(range(resumed + 1, STEPS + 1)), after

    got = digest_in(out, STEPS)
    assert got is not None, out
    assert got == _reference_sha(tmp_path, resumed), (resumed, out[-4000:])
