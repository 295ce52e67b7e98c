"""The README's main job (examples/train_gpt.py, shrunk to run for seconds) under `shoal run`,
scraped by a real Prometheus that evaluates deploy/prometheus's rules: on its first run every
panel of the dashboard's training row and checkpoint row answers for both ranks, and the
recording rules fill. (Before, no example called shoal.metrics and the row stayed empty.)"""

from __future__ import annotations

import json

from tests.support.prometheus_server import PrometheusServer, require_prometheus
from tests.support.shoal_run import ROOT, ShoalRun

DASHBOARD = ROOT / "deploy" / "grafana" / "shoal-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "shoal-rules.yml"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval for a 500 ms scrape is at least 4 scrapes
TRAINING_ROW = ("Loss", "Samples per second, per rank", "Step time, per rank",
                "Work per step, per rank: who holds the others up?",
                "Straggler heatmap: work per step by rank over time",
                "Time waiting in collectives, per rank", "Since the last step, per rank",
                "Last step, per rank")
CHECKPOINT_ROW = ("Since the last checkpoint", "Steps a failure would lose",
                  "How long did the last checkpoint save and load take?")


def _queries(run_id: str) -> dict[str, str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {p["title"]: t["expr"].replace("$__rate_interval", RATE_INTERVAL)
            .replace('"$run"', f'"{run_id}"').replace('"$rank"', '".*"')
            for p in dashboard["panels"] for t in p.get("targets", [])}


def test_the_main_job_fills_the_training_row_and_the_recording_rules(tmp_path):
    require_prometheus()
    run_id = "gpt"
    args = ["--nproc-per-node", "2", "--metrics-port", "0", "--rdzv-id", run_id,
            "--checkpoint-dir", str(tmp_path / "ckpt"), str(ROOT / "examples" / "train_gpt.py"),
            "--steps", "400", "--step-sleep", "0.02", "--log-every", "200", "--d-model", "32",
            "--layers", "1", "--heads", "2", "--context", "16", "--batch-size", "4",
            "--eval-windows", "8", "--sample-chars", "5", "--checkpoint-every", "20",
            "--plot", str(tmp_path / "loss.png")]
    queries = _queries(run_id)
    with ShoalRun(args, name="main job") as run:
        port = int(run.wait_for(r"Metrics of this node's agent and workers at "
                                r"http://127\.0\.0\.1:(\d+)/metrics", 30).group(1))
        with PrometheusServer([f"127.0.0.1:{port}"], rules=str(RULES)) as prom:
            prom.wait_for_series(f'shoal_training_last_step{{run_id="{run_id}"}} > 40', 60)
            for title in TRAINING_ROW:
                # Every per-rank panel answers for both ranks (a rate needs a whole window).
                answer = prom.wait_for_series(f"count({queries[title]}) == 2", 15)
                assert answer, title
            loss = prom.query(queries["Loss"])
            # Cross entropy over a vocabulary of ~100 characters starts near ln(100) = 4.6 and
            # only falls: any value in (0, 6) is a real loss, not a placeholder.
            assert all(0 < float(r["value"][1]) < 6 for r in loss), loss
            for title in CHECKPOINT_ROW:
                assert prom.wait_for_series(queries[title], 15), title
            for rule in ("shoal:training_step_seconds:mean_rate5m",
                         "shoal:collectives_wait:ratio_rate5m"):
                ranks = prom.wait_for_series(f'{rule}{{run_id="{run_id}"}}', 15)
                assert {r["metric"]["rank"] for r in ranks} == {"0", "1"}, (rule, ranks)
        assert run.wait(120) == 0, run.tail()
