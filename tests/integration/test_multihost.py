"""A job across hosts: two network-namespace hosts (tests/support/netns.py), etcd on the first,
one `shoal run` agent per host with two workers each. The ranks must reach each other at
addresses that route between the hosts (never loopback), and the job must end with exactly the
parameters of the same job run on one host over sockets."""

from __future__ import annotations

import contextlib
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
    WORKERS,
    ShoalRun,
    digest_in,
    final_sha,
)

pytestmark = pytest.mark.slow

STEPS = 12
TRAIN = [str(TRAIN_DDP), "--steps", str(STEPS), "--checkpoint-every", "4"]
JOB_TIMEOUT = 120
SECRET = "multihost-" + uuid.uuid4().hex


@contextlib.contextmanager
def _hosts_with_etcd(n: int):
    """`n` hosts, etcd serving on the first."""
    require_netns()
    with Hosts(n) as hosts:
        etcd = EtcdServer(host=hosts[0].address, command_prefix=hosts[0].command([]))
        try:
            etcd.start()
            yield hosts, etcd
        finally:
            etcd.close()


@pytest.fixture
def two_hosts():
    with _hosts_with_etcd(2) as made:
        yield made


@pytest.fixture(scope="module")
def one_host_sha(tmp_path_factory):
    """The same 4-rank job on one host, its ranks linked by sockets as across hosts."""
    ck = tmp_path_factory.mktemp("one-host")
    with ShoalRun(["--standalone", "--nproc-per-node", "4", "--checkpoint-dir", str(ck)] + TRAIN,
                  env={"SHOAL_LOCAL_TRANSPORT": "unix"}, name="one host") as run:
        assert run.wait(JOB_TIMEOUT) == 0, run.tail()
    return final_sha(run, STEPS)


def _agent(host, etcd, run_id, tmp_path, extra=(), job=TRAIN, nproc=2, nnodes="2", env=None):
    argv = [sys.executable, "-m", "shoal.launcher", "run", "--nnodes", nnodes,
            "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--max-restarts", "0",
            "--checkpoint-dir", str(tmp_path / f"ck-{host.index}"), *extra, *job]
    env = {**os.environ, "SHOAL_AUTH_TOKEN": SECRET, **(env or {})}
    return host.popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)


def _finish(procs) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
    return outputs


@pytest.mark.parametrize("local_addr", ["default", "explicit"])
def test_two_hosts_train_as_one_host_would(two_hosts, one_host_sha, tmp_path, local_addr):
    hosts, etcd = two_hosts
    run_id = f"mh-{uuid.uuid4().hex[:8]}"
    procs = [_agent(h, etcd, run_id, tmp_path,
                    ["--local-addr", h.address] if local_addr == "explicit" else [])
             for h in hosts.hosts]
    outputs = _finish(procs)
    digests = [digest_in(out, STEPS) for out in outputs]
    assert [d for d in digests if d] == [one_host_sha], outputs[0][-4000:]


def test_rpc_workers_on_two_hosts_reach_each_other(two_hosts, tmp_path):
    """One RPC worker per host: each advertises the address that routes to the store's host, so
    the RRef owner on one host serves calls from the other."""
    hosts, etcd = two_hosts
    run_id = f"mh-rpc-{uuid.uuid4().hex[:8]}"
    job = [str(ROOT / "examples" / "rpc_accumulator.py")]
    outputs = _finish([_agent(h, etcd, run_id, tmp_path, job=job, nproc=1)
                       for h in hosts.hosts])
    joined = "\n".join(outputs)
    assert "remote total: [10. 10. 10. 10.] owner: worker0" in joined, joined[-4000:]
    assert "sum via rpc_sync: [3. 3.]" in joined


@pytest.mark.parametrize("nhosts, nproc, leaders, path, layout", [
    (2, 2, None, "hierarchical", "0,1 | 2,3"),
    (2, 2, 2, "hierarchical", "0,1 | 2,3"),
    (2, 3, 2, "hierarchical", "0,1,2 | 3,4,5"),
    (3, 1, None, "sockets", "0 | 1 | 2"),
    (1, 4, None, "shared memory", "0,1,2,3"),
], ids=["2x2", "2x2-two-leaders", "2x3-two-leaders", "3x1", "1x4"])
def test_the_collective_catalogue_across_hosts(tmp_path, nhosts, nproc, leaders, path, layout):
    """Every collective, checked against numpy and bitwise across ranks on every rank
    (workers/catalogue.py, which also runs subgroups), with ranks on several hosts: two-level
    algorithms when a host has several ranks (shared memory within, TCP between), sockets when
    every host has one, shared memory alone on one host; with one leader per host (the default
    on 2 cores) and with two, also for hosts of three ranks (a leader then carries two ranks'
    share). Each rank reports the topology it learned and the path it took."""
    with _hosts_with_etcd(nhosts) as (hosts, etcd):
        run_id = f"mh-cat-{uuid.uuid4().hex[:8]}"
        job = [str(WORKERS / "catalogue.py")]
        env = {"SHOAL_HIER_LEADERS": str(leaders)} if leaders else {}
        outputs = _finish([_agent(h, etcd, run_id, tmp_path, job=job, nproc=nproc,
                                  nnodes=str(nhosts), env=env) for h in hosts.hosts])
    joined = "\n".join(outputs)
    for rank in range(nhosts * nproc):
        assert f"[rank {rank}] path {path} hosts {layout}" in joined, joined[-4000:]
        if leaders:
            assert f"[rank {rank}] leaders per host {leaders}" in joined, joined[-4000:]
        assert f"[rank {rank}] catalogue ok" in joined, joined[-4000:]
        # Links within a host keep shoal's small fixed buffers; the kernel autotunes the
        # receive buffer of every link to another host (wire.tune_socket).
        peers = [q for q in range(nhosts * nproc) if q != rank]
        expected = " ".join("fixed" if q // nproc == rank // nproc else "auto" for q in peers)
        assert f"[rank {rank}] receive buffers {expected}" in joined, joined[-4000:]


def test_a_lost_host_leaves_the_others_to_finish_from_the_last_checkpoint(tmp_path):
    """Two hosts x 2 ranks (--nnodes 1:2, one shared checkpoint directory, as shared storage
    would be), with a model wide enough (a 76816-byte gradient bucket) that DDP's all_reduce
    takes the two-level path (shared memory within a host, TCP between). After step 9 the
    second host is torn down (link cut, agent and workers killed). The first host's agent
    re-rendezvouses alone, resumes from step 8 at world size 2 and ends with the parameters of
    the same schedule run without a fault on the same paths: 2 hosts x 2 ranks to step 8, then
    one host of 2 ranks."""
    steps, every = 16, 4
    model = [str(WORKERS / "fault_at.py"), "--fault", "none", "--hidden", "128", "--say-path"]
    conf = ["--rdzv-conf", "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"]
    with _hosts_with_etcd(2) as (hosts, etcd):
        # The reference's first leg: the same 4 ranks on the same hosts, no fault.
        ck = tmp_path / "reference"
        reference = [*model, "--checkpoint-every", str(every), "--checkpoint-dir", str(ck)]
        run_id = f"mh-ref-{uuid.uuid4().hex[:8]}"
        first_leg = _finish([_agent(h, etcd, run_id, tmp_path, job=[*reference, "--steps", "8"],
                                    extra=["--node-rank", str(h.index)]) for h in hosts.hosts])
        assert "[rank 0] all_reduce path hierarchical" in first_leg[0], first_leg[0][-4000:]
        job = [*model, "--steps", str(steps), "--checkpoint-every", str(every),
               "--step-sleep", "0.2", "--checkpoint-dir", str(tmp_path / "shared")]
        run_id = f"mh-lost-{uuid.uuid4().hex[:8]}"
        # Node ranks fix where rank 0 (the one that prints) runs: on the surviving host.
        procs = [_agent(h, etcd, run_id, tmp_path, job=job, nnodes="1:2",
                        extra=["--max-restarts", "1", "--node-rank", str(h.index), *conf])
                 for h in hosts.hosts]
        survivor, lost = procs
        seen: list[str] = []
        for line in survivor.stdout:  # bounded: the job fails its test timeout otherwise
            seen.append(line)
            if "[rank 0] step 9 " in line:
                break
        hosts.cut(hosts[1])
        rest, _ = survivor.communicate(timeout=JOB_TIMEOUT)
    out = "".join(seen) + rest
    assert survivor.returncode == 0, out[-4000:]
    assert lost.returncode is not None
    assert "resumed from step 8" in out, out[-4000:]
    paths = re.findall(r"\[rank 0\] all_reduce path (.+)", out)
    assert paths == ["hierarchical", "shared memory"], paths
    got = digest_in(out, steps)

    # The reference's second leg: one host of 2 ranks (shared memory, as the survivor runs).
    with ShoalRun(["--standalone", "--nproc-per-node", "2", *reference, "--steps", str(steps)],
                  env={"SHOAL_AUTH_TOKEN": SECRET}, name="reference W=2") as run:
        assert run.wait(JOB_TIMEOUT) == 0, run.tail()
    assert "resumed from step 8" in run.output, run.tail()
    assert got == final_sha(run, steps), out[-4000:]


@pytest.mark.parametrize("leaders, pipeline", [(1, 0), (2, 1)], ids=["one-leader", "two-pipelined"])
def test_a_rank_killed_inside_a_two_level_all_reduce_is_named_on_every_other_rank(leaders,
                                                                                  pipeline):
    """2 hosts x 2 ranks started with env:// (no agent to tear the others down); the last rank
    SIGKILLs itself between two-level all_reduces of 16 MiB. Every other rank, whether it was
    in the shared-memory phase with it, in a cross-host ring with it or neither, raises a
    PeerLost (a CollectiveError) naming rank 3, well within the group's timeout."""
    require_netns()
    with Hosts(2) as hosts:
        env = {**os.environ, "SHOAL_AUTH_TOKEN": SECRET, "MASTER_ADDR": hosts[0].address,
               "MASTER_PORT": "29610", "WORLD_SIZE": "4", "SHOAL_HIER_LEADERS": str(leaders),
               "SHOAL_HIER_PIPELINE": str(pipeline)}
        procs = [hosts[r // 2].popen([sys.executable, str(WORKERS / "hier_fault.py")], cwd=ROOT,
                                     env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                 for r in range(4)]
        outputs = _finish(procs[:3])
        procs[3].wait(30)
    joined = "\n".join(outputs)
    assert "[rank 0] hierarchical True" in joined, joined[-4000:]
    for rank in range(3):
        line = next((ln for ln in joined.splitlines() if ln.startswith(f"[rank {rank}] failed")),
                    None)
        assert line is not None, joined[-4000:]
        assert ": PeerLost: " in line, line
        assert "rank 3" in line, line
        assert float(line.split(" in ")[1].split("s:")[0]) < 30, line
