"""A peer SIGKILLed between collectives is counted under `shoal run`, every time (issue 37).

The survivor's group counts the PeerLost (op "none": no collective ran) from its own thread,
while the agent, which reaps the dead worker at the same moment, stops the survivor for the
restart. The agent used to send its SIGTERM first in about one round of three on a busy
machine, and that loss was never counted. Here one job loses rank 1 between two collectives in
each of ROUNDS attempts; each attempt's rank 0 reads the job's counts so far from every earlier
worker's metric files, and the agent's /metrics serves the total at the end: exactly one
peer_lost per death, and no other error. The same holds when the killed rank runs on another
node, whose agent ends the round: the survivor's agent stops it only once it reads that from
the rendezvous (its poll), long after the survivor counted.
"""

from __future__ import annotations

import json
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.shoal_run import WORKERS, ShoalRun

ROUNDS = 5
METRICS_AT = r"Metrics of this node's agent and workers at (http://127\.0\.0\.1:\d+/metrics)"


def _served_errors(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {f"{s.labels['op']}/{s.labels['kind']}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "shoal_collectives_errors_total" and s.value}


def _counted_per_attempt(run: ShoalRun) -> dict:
    counted = {}
    for line in run.lines():
        match = re.search(r"\[rank 0\] attempt (\d+) errors (\{.*\})", line)
        if match:
            counted[int(match.group(1))] = json.loads(match.group(2))
    return counted


# Attempt k starts after k deaths, each counted once by its survivor.
EXPECTED = {k: ({"none/peer_lost": float(k)} if k else {}) for k in range(ROUNDS + 1)}


def _job_args(tmp_path, stop) -> list[str]:
    return ["--max-restarts", str(ROUNDS), "--metrics-port", "0",
            str(WORKERS / "killed_between_ops.py"), "--out", str(tmp_path), "--rounds",
            str(ROUNDS), "--stop-file", str(stop)]


def test_a_peer_killed_between_collectives_is_counted_in_every_round(tmp_path):
    stop = tmp_path / "stop"
    args = ["--nproc-per-node", "2", "--rdzv-id", "lost-peers", *_job_args(tmp_path, stop)]
    with ShoalRun(args, name="lost peers") as run:
        url = run.wait_for(METRICS_AT, 30).group(1)
        run.wait_for(r"last attempt ready", 120)
        assert _counted_per_attempt(run) == EXPECTED, run.tail()
        assert _served_errors(url) == {"none/peer_lost": float(ROUNDS)}
        stop.touch()
        assert run.wait(60) == 0, run.tail()


def test_a_peer_killed_on_another_node_is_counted_in_every_round(tmp_path):
    # Rank 0 on node A, rank 1 (killed) on node B: node B's agent ends each round, and node A's
    # agent stops its rank 0 once it reads that from the rendezvous.
    stop = tmp_path / "stop"
    base = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", "lost-remote-peers"]
    a = ShoalRun([*base, "--rdzv-endpoint", "127.0.0.1:0", "--node-rank", "0",
                  *_job_args(tmp_path, stop)], name="node A")
    with a:
        b = ShoalRun([*base, "--rdzv-endpoint", f"127.0.0.1:{a.store_port()}", "--node-rank",
                      "1", *_job_args(tmp_path, stop)], name="node B")
        with b:
            url = a.wait_for(METRICS_AT, 30).group(1)
            a.wait_for(r"last attempt ready", 120)
            assert _counted_per_attempt(a) == EXPECTED, a.tail() + "\n" + b.tail()
            assert _served_errors(url) == {"none/peer_lost": float(ROUNDS)}
            stop.touch()
            assert a.wait(60) == 0, a.tail()
            assert b.wait(60) == 0, b.tail()
