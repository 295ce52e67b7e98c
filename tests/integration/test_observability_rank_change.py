"""A node whose ranks change after a re-rendezvous stops serving the ranks it no longer runs.

Two `shoal run` agents on a real etcd form one job of 4 ranks (2 per node). The agent running
ranks 0 and 1 is SIGKILLed; the other one, which ran ranks 2 and 3, re-rendezvouses alone and
runs ranks 0 and 1 of 2. Its /metrics must then name ranks 0 and 1 only: the heartbeats and
counters its earlier workers left for ranks 2 and 3 would otherwise stay frozen (a false "no
progress" alert, phantom ranks on every per-rank panel).
"""

from __future__ import annotations

import re
import urllib.request
import uuid

from prometheus_client.parser import text_string_to_metric_families

from tests.support.shoal_run import WORKERS, ShoalRun

# Short heartbeats so the killed agent is noticed in about 2 s.
RDZV_CONF = "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5"
METRICS_AT = r"Metrics of this node's agent and workers at (http://127\.0\.0\.1:\d+/metrics)"
PER_RANK = ("shoal_collectives_last_op_timestamp_seconds", "shoal_collectives_wait_seconds_total",
            "shoal_worker_resident_memory_bytes")


def _ranks_served(url: str) -> dict[str, set]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    found: dict[str, set] = {name: set() for name in PER_RANK}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name].add(sample.labels["rank"])
    return found


def _ranks_of(run: ShoalRun, world: int, timeout: float, start: int = 0) -> list[int]:
    match = run.wait_for(rf"runs ranks \[([0-9, ]+)\] of {world} ", timeout, start)
    return [int(r) for r in match.group(1).split(",")]


def _all_did_allreduces(run: ShoalRun, ranks, timeout: float, start: int) -> None:
    for rank in ranks:
        run.wait_for(rf"\[rank {rank}\] rank {rank} did 5 allreduces", timeout, start)


def test_ranks_a_node_no_longer_runs_leave_its_scrape(etcd, tmp_path):
    stop = tmp_path / "stop"
    base = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
            "--rdzv-id", f"ranks-{uuid.uuid4().hex[:8]}", "--rdzv-conf", RDZV_CONF,
            "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--metrics-port", "0"]
    worker = [str(WORKERS / "metrics_worker.py"), "--stop-file", str(stop)]
    with ShoalRun(base + ["--node-rank", "0"] + worker, name="node A") as a, \
            ShoalRun(base + ["--node-rank", "1"] + worker, name="node B") as b:
        try:
            # The rendezvous decides which node runs ranks 2 and 3: that one stays.
            stays, goes = (a, b) if _ranks_of(a, 4, 60) == [2, 3] else (b, a)
            assert _ranks_of(stays, 4, 60) == [2, 3], stays.tail()
            url = stays.wait_for(METRICS_AT, 30).group(1)
            _all_did_allreduces(stays, (2, 3), 60, 0)
            assert _ranks_served(url) == {name: {"2", "3"} for name in PER_RANK}

            goes.kill()  # SIGKILL the agent of ranks 0 and 1; its workers die with it
            assert _ranks_of(stays, 2, 60, stays.last_index + 1) == [0, 1], stays.tail()
            new_round = stays.last_index
            _all_did_allreduces(stays, (0, 1), 60, new_round)
            assert _ranks_served(url) == {name: {"0", "1"} for name in PER_RANK}, stays.tail()
        finally:
            stop.touch()
        assert stays.wait(60) == 0, stays.tail()
    assert re.search(r"Round \d+: node rank 0 of 1 runs ranks \[0, 1\] of 2", stays.output)
