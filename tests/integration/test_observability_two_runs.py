"""Two `shoal run` jobs at once on one machine, with different --rdzv-id, scraped by one
Prometheus job (one scrape config, two targets): their series stay apart by the run_id label
that each agent adds itself, so the dashboard's run selector shows each job's own figures.

Run "alpha" has rank 1 as its straggler and no failure; run "beta" has rank 0 as its straggler
and one failure (rank 1 exits once). Every shoal series carries a run_id, and each run's job
info, workers, restarts, straggler and step rate are its own, not the sum of both.
"""

from __future__ import annotations

import json
import time

from tests.support.prometheus_server import PrometheusServer
from tests.support.shoal_run import ROOT, WORKERS, ShoalRun

DASHBOARD = ROOT / "deploy" / "grafana" / "shoal-dashboard.json"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval for a 500 ms scrape is at least 4 scrapes
METRICS_AT = r"Metrics of this node's agent and workers at http://127\.0\.0\.1:(\d+)/metrics"


def _straggler_expr(run_id: str) -> str:
    """The dashboard's straggler query with its run selector set to `run_id`."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (expr,) = [t["expr"] for p in panels if p["title"] == "Which rank is the straggler?"
               for t in p["targets"]]
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$run"', f'"{run_id}"')


def _by_run(result) -> dict[str, float]:
    return {r["metric"]["run_id"]: float(r["value"][1]) for r in result}


def _job(tmp_path, run_id: str, *extra: str) -> tuple[ShoalRun, object]:
    stop = tmp_path / f"stop-{run_id}"
    args = ["--nproc-per-node", "2", "--metrics-port", "0", "--rdzv-id", run_id,
            "--max-restarts", "3", "--checkpoint-dir", str(tmp_path / f"ckpt-{run_id}"),
            str(WORKERS / "observed_job.py"), "--stop-file", str(stop), *extra]
    return ShoalRun(args, name=f"run {run_id}"), stop


def test_two_runs_under_one_prometheus_job_stay_apart(tmp_path):
    alpha, stop_alpha = _job(tmp_path, "alpha", "--straggler", "1")
    beta, stop_beta = _job(tmp_path, "beta", "--straggler", "0", "--fail-rank", "1",
                           "--fail-step", "5")
    with alpha, beta:
        try:
            ports = [int(run.wait_for(METRICS_AT, 30).group(1)) for run in (alpha, beta)]
            beta.wait_for(r"rank 1 fails at step 5 on purpose", 60)
            for run in (alpha, beta):
                run.wait_for(r"\[rank 1\] rank 1 at step 20", 90)
            with PrometheusServer([f"127.0.0.1:{p}" for p in ports]) as prom:
                prom.wait_for_series('shoal_training_last_step{run_id="beta"} > 20', 30)
                prom.wait_for_series('shoal_training_last_step{run_id="alpha"} > 20', 30)
                time.sleep(4)  # a full rate window

                # One scrape job, two targets: every shoal series names its run.
                assert prom.query('{job="shoal", __name__=~"shoal_.+", run_id=""}') == []
                info = prom.query("shoal_job_info")
                assert {(r["metric"]["run_id"], r["metric"]["instance"]) for r in info} == {
                    ("alpha", f"127.0.0.1:{ports[0]}"), ("beta", f"127.0.0.1:{ports[1]}")}
                assert _by_run(prom.query(
                    'sum by (run_id) (shoal_elastic_workers{state="running"})')) == {
                    "alpha": 2.0, "beta": 2.0}
                assert _by_run(prom.query("max by (run_id) (shoal_elastic_job_restarts)")) == {
                    "alpha": 0.0, "beta": 1.0}
                assert _by_run(prom.query(
                    'sum by (run_id) (shoal_elastic_worker_exits_total{state="failed"})')) == {
                    "alpha": 0.0, "beta": 1.0}
                # Two ranks per run, not two ranks summed over both runs.
                ranks = prom.query("count by (run_id) (shoal_training_last_step)")
                assert _by_run(ranks) == {"alpha": 2.0, "beta": 2.0}
                # Each run's straggler is its own.
                for run_id, straggler in (("alpha", "1"), ("beta", "0")):
                    (named,) = prom.query(_straggler_expr(run_id))
                    assert named["metric"]["rank"] == straggler, (run_id, named)
        finally:
            stop_alpha.touch()
            stop_beta.touch()
        assert alpha.wait(60) == 0, alpha.tail()
        assert beta.wait(60) == 0, beta.tail()
