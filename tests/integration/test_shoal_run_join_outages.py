"""`shoal run` on etcd while an agent waits for its round to form: an etcd that dies ends the
agent after join_outage_timeout with one line naming the endpoint, the time and what it waited
for (not after the 600 s join timeout); an etcd restart shorter than that costs nothing."""

import re
import time
import uuid

import pytest

from tests.support.shoal_run import WORKERS, ShoalRun

ENV_WORKER = str(WORKERS / "env_worker.py")
GRACE_S = 4
RDZV_CONF = (f"heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5,"
             f"join_outage_timeout={GRACE_S}")
# From giving up to the exit: stopping, leaving without etcd (the agent's exit budget is 8 s;
# in practice about 2 s).
EXIT_BOUND_S = 8.0


def _node(etcd, run_id: str, conf: str = RDZV_CONF) -> ShoalRun:
    return ShoalRun(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                     "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
                     "--rdzv-conf", conf, ENV_WORKER, "--wait", "0"], name="node")


@pytest.mark.slow
def test_an_agent_waiting_for_its_round_gives_up_soon_after_etcd_dies(etcd):
    run_id = f"join-outage-{uuid.uuid4().hex[:8]}"
    with _node(etcd, run_id) as run:
        run.wait_for(r"waiting for 1 more node\(s\)", 30)
        etcd.kill()
        killed = time.monotonic()
        code = run.wait(GRACE_S + EXIT_BOUND_S + 20)
        took = time.monotonic() - killed
        lines = run.lines()
    assert code == 1, run.tail()
    # Not before the grace (its clock starts at etcd's last answer, at most a heartbeat before
    # the kill), and well before the join timeout.
    assert GRACE_S - 0.5 <= took < GRACE_S + EXIT_BOUND_S, f"took {took:.1f}s:\n{run.tail()}"
    node = re.escape(run.wait_for(r"Node (\S+) joins run", 1).group(1))
    expected = re.compile(
        rf"shoal run: the rendezvous failed: etcd at {re.escape(etcd.endpoint)} was "
        rf"unreachable for [45]s \(join_outage_timeout={GRACE_S}s\) while node {node} waited "
        rf"for round 0 of run '{run_id}' to form \(1 of min_nodes=2 joined: {node}\); giving "
        r"up the join\.")
    assert any(expected.fullmatch(line) for line in lines), run.tail()
    # The operator was told when the outage began, and how long the agent would wait.
    assert any(re.search(rf"etcd at {re.escape(etcd.endpoint)} does not answer while node "
                         rf"{node} waits .* giving up in [0-9]s unless it comes back", line)
               for line in lines), run.tail()


@pytest.mark.slow
def test_an_etcd_restart_shorter_than_the_grace_costs_a_waiting_agent_nothing(etcd):
    run_id = f"join-restart-{uuid.uuid4().hex[:8]}"
    # A grace only a little longer than the outage: it is counted from etcd's last answer.
    conf = RDZV_CONF.replace(f"join_outage_timeout={GRACE_S}", "join_outage_timeout=8")
    with _node(etcd, run_id, conf) as first:
        first.wait_for(r"waiting for 1 more node\(s\)", 30)
        etcd.restart(downtime=3.0)
        with _node(etcd, run_id, conf) as second:
            assert second.wait(60) == 0, second.tail()
            assert first.wait(30) == 0, first.tail()
    assert "giving up the join" not in first.output
    # The outage was seen while waiting (so this test is not vacuous).
    assert re.search(r"etcd at \S+ does not answer while node \S+ waits", first.output), \
        first.tail()


@pytest.mark.slow
def test_an_agent_waiting_for_its_round_ends_within_seconds_when_the_store_host_dies():
    # The embedded store's host is the other waiting node: its death is noticed by the store
    # watch (heartbeat_timeout), long before join_outage_timeout would end the join.
    args = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-id", "store-wait",
            "--rdzv-conf", RDZV_CONF.replace(f"join_outage_timeout={GRACE_S}",
                                             "join_outage_timeout=60")]
    host = ShoalRun(args + ["--rdzv-endpoint", "127.0.0.1:0", "--node-rank", "0",
                            ENV_WORKER], name="node A")
    with host:
        port = host.store_port()
        host_id = host.wait_for(r"Node (\S+) joins run", 30).group(1)
        other = ShoalRun(args + ["--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", "1",
                                 ENV_WORKER], name="node B")
        with other:
            other.wait_for(r"waiting for 1 more node\(s\)", 30)
            host.kill()
            killed = time.monotonic()
            code = other.wait(30)
            took = time.monotonic() - killed
    assert code == 1, other.tail()
    assert took < 2 + EXIT_BOUND_S, f"node B needed {took:.1f}s:\n{other.tail()}"
    assert re.search(rf"^shoal run: .*the store host node {re.escape(host_id)} at "
                     rf"127\.0\.0\.1:{port} is gone", other.output, re.M), other.tail()
