"""The operator's view, checked end to end: a real 2-worker DDP + RPC job under `shoal run`
with a deliberate straggler (rank 1 computes 8x longer) and a deliberate failure (rank 0 exits 1
once, at step 20), scraped every 500 ms by a real Prometheus that also evaluates
deploy/prometheus's rules.

- every query of deploy/grafana/shoal-dashboard.json runs through Prometheus' HTTP API at one
  instant and each panel's answer is checked against what the job did: the failure and the
  restart count as 1, the straggler's rank is named and does the most work per step while the
  other waits, samples/s is 8 x steps/s, collectives and RPCs per second follow the step rate,
  the checkpoint is recent and the steps a failure would lose are within the checkpoint
  interval, and so on (every panel has a check: a new panel needs one);
- right after the failure the "are collectives failing?" panel shows the peer_lost error of
  rank 1 (rank 0 left the group while rank 1 waited for it in the gradient all-reduce);
- every metric the dashboard names is one the job actually exported;
- ShoalWorkersRestarted fires for the real restart, and ShoalNoProgress for both ranks once the
  job stalls (thresholds shortened from minutes to seconds, the expressions otherwise as
  shipped);
- the agent's final state (both workers succeeded) reaches Prometheus although the agent exits
  right after: the metrics server waits for one more scrape.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.prometheus_server import PrometheusServer
from tests.support.shoal_run import WORKERS, ShoalRun

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "shoal-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "shoal-rules.yml"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval for a 500 ms scrape is at least 4 scrapes


class RulesPrometheus(PrometheusServer):
    """PrometheusServer that also evaluates `rules` every 500 ms."""

    def __init__(self, targets, rules: Path):
        super().__init__(targets)
        with open(self.config_path) as f:
            config = f.read()
        config = config.replace("global:\n", "global:\n  evaluation_interval: 500ms\n", 1)
        with open(self.config_path, "w") as f:
            f.write(config + f"rule_files:\n  - {rules}\n")

    def alerts(self, name: str) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=5) as reply:
            body = json.loads(reply.read())
        return [a for a in body["data"]["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == "firing"]

    def wait_for_alert(self, name: str, timeout: float, count: int = 1) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            firing = self.alerts(name)
            if len(firing) >= count:
                return firing
            if time.monotonic() > deadline:
                pytest.fail(f"{name} is not firing ({len(firing)} of {count}) after {timeout}s")
            time.sleep(0.25)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _targets() -> list[tuple[str, str, str]]:
    """(panel title, refId, expression) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in dashboard["panels"]
            for t in p.get("targets", [])]


def _panels() -> list[tuple[str, str]]:
    return [(title, expr) for title, _, expr in _targets()]


def _instant(expr: str, run_id: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$run"', f'"{run_id}"')
            .replace('"$rank"', '".*"'))


def _values(result) -> list[float]:
    return [float(r["value"][1]) for r in result]


def _by(result, label: str) -> dict[str, float]:
    """{value of `label`: sample value} of an instant query's result."""
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


def _one(result) -> float:
    (value,) = _values(result)
    return value


CHECKPOINT_EVERY = 5  # observed_job.py: rank 0 saves after every 5th step
BATCH = 8  # observed_job.py: samples per step
STRAGGLER_COMPUTE_S = 0.08  # observed_job.py: --compute 0.01, x8 for the straggler
# Bytes each rank hands to all_reduce per step: the Linear(256, 256) gradients in one DDP
# bucket (float32) and the two stop/stall flags.
ALLREDUCE_BYTES_PER_STEP = (256 * 256 + 256) * 4 + 2 * 4


# Panels that answer nothing while no rank hangs (Grafana shows their "no value" text);
# tests/integration/test_observability_alerts.py sees them answer during a hang.
EMPTY_WHEN_HEALTHY = {"Which rank do the others wait for?"}


def _close(value: float, reference: float, rel: float) -> bool:
    return abs(value - reference) <= rel * abs(reference)


def _check_panels(a: dict, steps_per_s: float, since_failure: float) -> set:
    """Check every panel's answer (`a`: title -> refId -> result); returns the titles checked."""
    checked = set()

    def panel(title: str, ref: str = "A"):
        checked.add(title)
        return a[title][ref]

    # Job health.
    assert _one(panel("Nodes reporting")) == 1
    assert _one(panel("Workers running")) == 2
    assert _one(panel("Restarts used")) == 1
    assert _one(panel("Restarts left")) == 2
    assert _one(panel("Worker failures")) == 1
    assert 0 < _one(panel("Since the last restart")) < since_failure + 5
    assert _by(panel("Restarts so far, by reason"), "reason") == {
        "worker_failure": 1.0, "peer_request": 0.0, "scale_up": 0.0, "node_lost": 0.0}
    assert _by(panel("Workers by state, per node"), "state") == {
        "running": 2.0, "succeeded": 0.0, "failed": 0.0, "stopped": 0.0}
    assert 0 < _one(panel("How long did the last rendezvous take?")) < 30
    # Rank 0 failed; rank 1's group found rank 0 gone and ended it with exit status 75
    # (aborted) before the agent stopped it.
    assert _by(panel("Worker exits by how"), "state") == {
        "failed": 1.0, "aborted": 1.0, "succeeded": 0.0, "stopped": 0.0}

    # Training. A fresh Linear(256, 256) (torch's init) gives a mean square output of about
    # 1/3 on standard normal inputs, and SGD only lowers it.
    loss = _by(panel("Loss"), "rank")
    assert set(loss) == {"0", "1"} and all(0 < v < 1 for v in loss.values()), loss
    samples = _by(panel("Samples per second, per rank"), "rank")
    assert set(samples) == {"0", "1"}
    assert all(_close(v, BATCH * steps_per_s, 0.1) for v in samples.values()), \
        (samples, steps_per_s)
    # DDP all-reduces the gradients inside the step: rank 0 waits there for rank 1, so both
    # ranks' steps take the straggler's time, and step time does not tell them apart ...
    step = _by(panel("Step time, per rank"), "rank")
    assert set(step) == {"0", "1"} and _close(step["0"], step["1"], 0.25), step
    assert min(step.values()) >= 0.95 * STRAGGLER_COMPUTE_S, step
    # ... the time a rank does not wait does: rank 1 computes 8x longer than rank 0.
    work = _by(panel("Work per step, per rank: who holds the others up?"), "rank")
    assert set(work) == {"0", "1"} and work["1"] > 3 * work["0"], work
    assert work["1"] >= 0.9 * STRAGGLER_COMPUTE_S, work
    assert _by(panel("Straggler heatmap: work per step by rank over time"), "rank") == work
    assert _by(panel("Which rank is the straggler?"), "rank").keys() == {"1"}
    # Nobody waits inside a collective for over a second in a healthy job: the hung-rank panel
    # is empty ("nobody"), and no rank has been inside one that long.
    assert panel("Which rank do the others wait for?") == []
    assert _by(panel("Inside one collective for, per rank"), "rank") == {"0": 0.0, "1": 0.0}
    wait = _by(panel("Time waiting in collectives, per rank"), "rank")
    assert set(wait) == {"0", "1"} and wait["0"] > wait["1"] + 0.3, wait
    assert all(0 <= v < 2 for v in _by(panel("Since the last step, per rank"), "rank").values())
    assert all(0 <= v < 2 for v in
               _by(panel("Since the last collective, per rank"), "rank").values())
    last = _by(panel("Last step, per rank"), "rank")
    assert set(last) == {"0", "1"} and min(last.values()) > 30, last
    assert max(last.values()) - min(last.values()) <= 1, last

    # Checkpoints: one every CHECKPOINT_EVERY steps, loaded once at the restart.
    assert 0 <= _one(panel("Since the last checkpoint")) < 5
    assert 0 <= _one(panel("Steps a failure would lose")) <= CHECKPOINT_EVERY
    took = _by(panel("How long did the last checkpoint save and load take?"), "operation")
    assert set(took) == {"save", "load"} and all(0 < v < 5 for v in took.values()), took
    assert _by(panel("Checkpoint bytes per second"), "operation")["save"] > 1000

    # Resources.
    rss = _by(panel("Resident memory, per rank"), "rank")
    assert set(rss) == {"0", "1"} and all(v > 10e6 for v in rss.values()), rss
    cpu = _by(panel("CPU, per rank"), "rank")
    assert set(cpu) == {"0", "1"} and all(0 < v < 2 for v in cpu.values()), cpu

    # Collectives: per step each rank all-reduces its gradient bucket and the flags.
    assert _one(panel("Watchdog dumps")) >= 1  # rank 1's, when it found rank 0 gone
    p99 = _by(panel("Collective latency p99, by op"), "op")
    assert 0 < p99["all_reduce"] < 1, p99
    ops = _by(panel("Collectives per second, by op"), "op")
    assert _close(ops["all_reduce"], 2 * 2 * steps_per_s, 0.25), (ops, steps_per_s)
    nbytes = _by(panel("Bytes into collectives per second, by op"), "op")
    assert _close(nbytes["all_reduce"], 2 * ALLREDUCE_BYTES_PER_STEP * steps_per_s, 0.25), \
        (nbytes, steps_per_s)
    # The failure is more than a rate window ago: nothing fails now.
    assert set(_values(panel("Are collectives failing?", "A"))) == {0.0}
    assert _values(panel("Are collectives failing?", "B")) == [0.0]

    # DDP: the model's one bucket waits on rank 0 for rank 1's (about 70 ms), on rank 1 hardly:
    # the mean over both ranks is about 35 ms. It is the last bucket, reduced inline once
    # backward is over, so none of it is hidden: the exposed wait is the bucket's time.
    bucket = _one(panel("Bucket allreduce time"))
    assert 0.01 < bucket < STRAGGLER_COMPUTE_S, bucket
    assert _close(_one(panel("Is gradient communication hidden behind backward?")), bucket,
                  0.3), bucket

    # RPC: one rpc_sync per rank per step, all answered.
    requests = {(r["metric"]["kind"], r["metric"]["status"]): float(r["value"][1])
                for r in panel("RPC requests per second, by kind and outcome")}
    assert _close(requests.pop(("sync", "ok")), 2 * steps_per_s, 0.25), steps_per_s
    assert set(requests.values()) == {0.0}, requests
    assert 0 < _by(panel("RPC latency p99, by kind"), "kind")["sync"] < 1
    assert _by(panel("Is someone knocking with a wrong token?"), "port") == {
        "stream": 0.0, "data": 0.0}
    assert 0 <= _one(panel("RPC calls in flight")) <= 2
    rpc_bytes = _by(panel("RPC bytes per second, by direction"), "direction")
    assert rpc_bytes.keys() == {"sent", "received"} and min(rpc_bytes.values()) > 0, rpc_bytes
    # Large received buffers are kept for reuse; this job's arguments are a few bytes.
    assert _one(panel("RPC receive cache")) == 0
    return checked


def test_every_dashboard_panel_and_two_alerts_against_a_real_job(tmp_path):
    rules = tmp_path / "rules.yml"
    # Minutes become seconds so the test does not wait for them; the expressions stay as shipped.
    rules.write_text(RULES.read_text().replace("> 600", "> 2"))
    port = _free_port()
    run_id = "observed"
    stop, stall = tmp_path / "stop", tmp_path / "stall"
    args = ["--nproc-per-node", "2", "--metrics-port", str(port), "--rdzv-id", run_id,
            "--max-restarts", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
            str(WORKERS / "observed_job.py"), "--stop-file", str(stop), "--stall-file",
            str(stall), "--straggler", "1", "--fail-rank", "0", "--fail-step", "20"]
    panels = _panels()
    with RulesPrometheus([f"127.0.0.1:{port}"], rules) as prom:
        # Prometheus applies its targets a few seconds after it starts: the job starts once it
        # scrapes, so the error series are scraped at 0 before the failure (increase() needs
        # that; an error before a target's first scrape shows in no rate or increase).
        prom.wait_for_series(f'up{{instance="127.0.0.1:{port}"}}', 30)
        with ShoalRun(args, name="observed job") as run:
            try:
                run.wait_for(r"rank 0 fails at step 20 on purpose", 60)
                failed_at = time.time()
                # The first error shows although its series was created before it (at 0).
                (errors_expr,) = [e for t, e in panels if t == "Are collectives failing?"
                                  and "errors_total" in e]
                errors = prom.wait_for_series(_instant(errors_expr, run_id) + " > 0", 15)
                assert _by(errors, "kind").keys() == {"peer_lost"}, errors
                assert _one(errors) >= 1

                run.wait_for(r"\[rank 0\] rank 0 at step 30", 60, start=run.last_index)
                prom.wait_for_series(f'shoal_training_last_step{{run_id="{run_id}"}} > 30', 30)
                time.sleep(4)  # a full rate window of the restarted job
                at = time.time() - 0.5  # every panel at one instant, scraped by then

                names = {r["metric"]["__name__"] for r in
                         prom.query(f'count by (__name__) ({{run_id="{run_id}"}})', at)}
                answers: dict = {}
                for title, ref, expr in _targets():
                    result = prom.query(_instant(expr, run_id), at)
                    assert result or title in EMPTY_WHEN_HEALTHY, \
                        f"panel {title!r} is empty: {expr}"
                    assert not any(v != v for v in _values(result)), \
                        f"panel {title!r} answers NaN: {result}"
                    answers.setdefault(title, {})[ref] = result
                    for name in re.findall(r"\bshoal_[a-z0-9_]+", expr):
                        assert name in names or title in EMPTY_WHEN_HEALTHY, \
                            f"panel {title!r} names {name}, never exported"
                steps_per_s = sum(_values(prom.query(
                    f'rate(shoal_training_step_seconds_count{{run_id="{run_id}"}}'
                    f'[{RATE_INTERVAL}])', at))) / 2
                checked = _check_panels(answers, steps_per_s, at - failed_at)
                assert checked == set(answers), f"panels without a check: {set(answers) - checked}"
                info = prom.query(f'shoal_job_info{{run_id="{run_id}"}}')[0]["metric"]
                assert (info["world_size"], info["nnodes"], info["max_restarts"]) == \
                    ("2", "1", "3")

                (restarted,) = prom.wait_for_alert("ShoalWorkersRestarted", 10)
                assert restarted["labels"]["run_id"] == run_id
                assert not prom.alerts("ShoalNoProgress")

                stall.touch()
                run.wait_for(r"stalls after step", 30)
                stuck = prom.wait_for_alert("ShoalNoProgress", 20, count=2)
                assert {a["labels"]["rank"] for a in stuck} == {"0", "1"}
            finally:
                stop.touch()
            assert run.wait(60) == 0, run.tail()
        # The agent exited after its last state was scraped: both workers succeeded. (Its
        # series went stale at the first failed scrape since: read the last value scraped.)
        done = prom.query(f'last_over_time(shoal_elastic_worker_exits_total{{run_id="{run_id}", '
                          f'state="succeeded"}}[1m])')
        assert _values(done) == [2.0], prom.log_tail()
