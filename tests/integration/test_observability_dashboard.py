"""The operator's view, checked end to end: a real 2-worker DDP + RPC job under `shoal run`
with a deliberate straggler (rank 1 computes 8x longer) and a deliberate failure (rank 0 exits 1
once), scraped every 500 ms by a real Prometheus that also evaluates deploy/prometheus's rules.

- every query of deploy/grafana/shoal-dashboard.json runs through Prometheus' HTTP API and
  returns a non-empty, non-NaN answer; the failure counts as exactly 1, the restart as 1, and
  the straggler panel names rank 1;
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


def _panels() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def _instant(expr: str, run_id: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$run"', f'"{run_id}"')
            .replace('"$rank"', '".*"'))


def _values(result) -> list[float]:
    return [float(r["value"][1]) for r in result]


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
            str(stall), "--straggler", "1", "--fail-rank", "0", "--fail-step", "3"]
    with RulesPrometheus([f"127.0.0.1:{port}"], rules) as prom:
        with ShoalRun(args, name="observed job") as run:
            try:
                run.wait_for(r"rank 0 fails at step 3 on purpose", 60)
                run.wait_for(r"\[rank 0\] rank 0 at step 20", 60)
                prom.wait_for_series(f'shoal_training_last_step{{run_id="{run_id}"}} > 20', 30)
                time.sleep(4)  # a full rate window of the restarted job

                names = {r["metric"]["__name__"] for r in
                         prom.query(f'count by (__name__) ({{run_id="{run_id}"}})')}
                answers = {}
                for title, expr in _panels():
                    result = prom.query(_instant(expr, run_id))
                    assert result, f"panel {title!r} is empty: {expr}"
                    assert not any(v != v for v in _values(result)), \
                        f"panel {title!r} answers NaN: {result}"
                    answers[title] = result
                    for name in re.findall(r"\bshoal_[a-z0-9_]+", expr):
                        assert name in names, f"panel {title!r} names {name}, never exported"

                assert _values(answers["Worker failures"]) == [1.0]
                assert _values(answers["Restarts used"]) == [1.0]
                assert _values(answers["Restarts left"]) == [2.0]
                by_reason = {r["metric"]["reason"]: float(r["value"][1])
                             for r in answers["Restarts so far, by reason"]}
                assert by_reason == {"worker_failure": 1.0, "peer_request": 0.0,
                                     "scale_up": 0.0, "node_lost": 0.0}
                exits = {r["metric"]["state"]: float(r["value"][1])
                         for r in answers["Worker exits by how"]}
                assert exits["failed"] == 1 and exits["succeeded"] == 0
                (straggler,) = answers["Which rank is the straggler?"]
                assert straggler["metric"]["rank"] == "1"
                assert {r["metric"]["rank"] for r in answers["Step time, per rank"]} == {"0", "1"}
                assert all(v > 10e6 for v in _values(answers["Resident memory, per rank"]))
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
        # The agent exited after its last state was scraped: both workers succeeded.
        done = prom.query(f'shoal_elastic_worker_exits_total{{run_id="{run_id}", '
                          f'state="succeeded"}}')
        assert _values(done) == [2.0], prom.log_tail()
