"""deploy/prometheus's alerts against real jobs under `shoal run`, scraped and evaluated every
500 ms by a real Prometheus (thresholds shortened from minutes to seconds; the expressions
otherwise as shipped):

- a clean run fires nothing, neither while it runs nor after its agent exits (ShoalAgentDown
  used to page for every finished local job), and the dashboard names no straggler; an agent
  killed mid-run does fire ShoalAgentDown;
- a one-rank hang fires ShoalNoProgress for the hung rank only, naming the rank that waits for
  it; the dashboard's "Which rank do the others wait for?" and `shoal top` name it too; the
  group's timeout then fires ShoalCollectiveTimeouts and ShoalCollectiveErrors for the rank
  that waited. (A peer SIGKILLed between collectives is counted too, under an agent that
  stops the survivor right after: test_observability_peer_loss.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.support.prometheus_server import PrometheusServer, require_prometheus
from tests.support.shoal_run import ROOT, WORKERS, ShoalRun

RULES = ROOT / "deploy" / "prometheus" / "shoal-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "shoal-dashboard.json"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval for a 500 ms scrape is at least 4 scrapes
# A hang ends at the group's collective timeout: after the checks of the hang (about 10 s in),
# long before a loaded machine's slowest run of them.
GROUP_TIMEOUT_S = 25
METRICS_LINE = r"Metrics of this node's agent and workers at http://127\.0\.0\.1:(\d+)/metrics"


def _rules(tmp_path: Path, no_progress_s: int) -> str:
    """The shipped rules with "10 minutes without progress" and ShoalAgentDown's 2 minutes
    shortened to seconds."""
    path = tmp_path / "rules.yml"
    text = RULES.read_text()
    assert "> 600" in text and "for: 2m" in text
    path.write_text(text.replace("> 600", f"> {no_progress_s}").replace("for: 2m", "for: 1s"))
    return str(path)


def _panel(title: str, run_id: str) -> str:
    """The dashboard panel's query for one run, as an instant query."""
    dashboard = json.loads(DASHBOARD.read_text())
    (expr,) = [t["expr"] for p in dashboard["panels"] if p["title"] == title
               for t in p.get("targets", [])]
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$run"', f'"{run_id}"')
            .replace('"$rank"', '".*"'))


def _job(tmp_path: Path, run_id: str, *extra: str) -> tuple[ShoalRun, Path]:
    stop = tmp_path / "stop"
    args = ["--nproc-per-node", "2", "--metrics-port", "0", "--rdzv-id", run_id,
            "--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
            str(WORKERS / "observed_job.py"), "--stop-file", str(stop), *extra]
    return ShoalRun(args, name=f"{run_id} job"), stop


def test_a_clean_run_fires_nothing_and_names_no_straggler(tmp_path):
    run_id = "clean"
    require_prometheus()
    run, stop = _job(tmp_path, run_id, "--compute", "0.03")
    with run:
        port = int(run.wait_for(METRICS_LINE, 30).group(1))
        target = f"127.0.0.1:{port}"
        with PrometheusServer([target], rules=_rules(tmp_path, 3)) as prom:
            try:
                prom.wait_for_series(f'shoal_training_last_step{{run_id="{run_id}"}} > 20', 60)
                # Both ranks do the same work: the rank that waits least exists, but the gap to
                # the other is noise, far under the panel's 10% of wall time.
                waits_expr = _panel("Time waiting in collectives, per rank", run_id)
                prom.wait_for_series(f"count({waits_expr}) == 2", 15)  # a whole rate window
                time.sleep(2)  # and the window past the job's start
                waits = prom.query(waits_expr)
                assert prom.query(_panel("Which rank is the straggler?", run_id)) == [], waits
                assert prom.query(_panel("Which rank do the others wait for?", run_id)) == []
                assert prom.alerts(state=None) == []
            finally:
                stop.touch()
            assert run.wait(60) == 0, run.tail()
            prom.wait_for_series(f'up{{instance="{target}"}} == 0', 10)
            # The situation ShoalAgentDown used to page for: a target down that served a job.
            old = "up == 0 and on (instance, job) max_over_time(shoal_job_info[1h])"
            assert prom.query(old)
            # Its `for` (1 s here) and a few evaluations pass: nothing pending, nothing firing.
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                assert prom.alerts(state=None) == [], prom.alerts(state=None)
                time.sleep(0.25)
            done = prom.query(f'shoal_elastic_workers{{run_id="{run_id}", state="succeeded"}}'
                              f'[1h]')
            assert done and float(done[0]["values"][-1][1]) == 2, done


def _top_once(port: int) -> str:
    done = subprocess.run([sys.executable, "-m", "shoal.launcher", "top", f"127.0.0.1:{port}",
                           "--once", "--interval", "0.5"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_one_rank_hang_is_named_by_the_alert_the_dashboard_and_top(tmp_path):
    run_id = "hung"
    hang = tmp_path / "hang"
    require_prometheus()
    run, stop = _job(tmp_path, run_id, "--hang-rank", "1", "--hang-file", str(hang),
                     "--timeout", str(GROUP_TIMEOUT_S))
    # 6 s without progress: rank 0's wait is reported (after 1 s inside the all-reduce) and
    # scraped long before; the group's own timeout comes later, and ends the hang.
    with run:
        port = int(run.wait_for(METRICS_LINE, 30).group(1))
        run.worker_pids(30)  # the workers started
        with PrometheusServer([f"127.0.0.1:{port}"], rules=_rules(tmp_path, 6)) as prom:
            try:
                # Scraped before the fault: the error series at 0, so increase() sees the error.
                prom.wait_for_series(f'shoal_training_last_step{{run_id="{run_id}"}} > 5', 60)
                hang.touch()
                run.wait_for(r"rank 1 hangs before step", 30)
                stuck = prom.wait_for_alert("ShoalNoProgress", 20)
                assert [a["labels"]["rank"] for a in stuck] == ["1"], stuck
                assert stuck[0]["annotations"]["description"].endswith(
                    "Ranks waiting for it inside a collective: 0."), stuck
                assert not prom.alerts("ShoalNoProgress", state="pending"), \
                    prom.alerts("ShoalNoProgress", state=None)

                awaited = prom.query(_panel("Which rank do the others wait for?", run_id))
                assert [r["metric"]["peer"] for r in awaited] == ["1"], awaited
                assert 6 < float(awaited[0]["value"][1]) < GROUP_TIMEOUT_S, awaited
                inside = {r["metric"]["rank"]: float(r["value"][1]) for r in
                          prom.query(_panel("Inside one collective for, per rank", run_id))}
                assert inside["1"] == 0 and inside["0"] > 6, inside

                screen = _top_once(port)
                rows = {line.split()[0]: line for line in screen.splitlines()
                        if line.strip()[:1].isdigit()}
                assert rows["1"].endswith("<- hung") and "hung" not in rows["0"], screen
                assert "rank 1 holds up the job: rank 0 waited for it inside a collective" \
                    in screen, screen

                # The group's timeout ends the hang: rank 0's watchdog fails the all-reduce,
                # counted as a timeout and as an error of kind timeout; the agent restarts.
                timeouts = prom.wait_for_alert("ShoalCollectiveTimeouts", GROUP_TIMEOUT_S + 20)
                assert {a["labels"]["op"] for a in timeouts} == {"all_reduce"}, timeouts
                errors = prom.wait_for_alert("ShoalCollectiveErrors", 10)
                assert {(a["labels"]["op"], a["labels"]["kind"]) for a in errors} == {
                    ("all_reduce", "timeout")}, errors
                run.wait_for(r"Started ranks \[0, 1\] as pids", 60, start=run.last_index + 1)
                # That restart was the only one --max-restarts 1 allows: the next failure ends
                # the job.
                (left,) = prom.wait_for_alert("ShoalRestartsNearlyExhausted", 15)
                assert left["labels"]["run_id"] == run_id, left
                prom.wait_for_series(
                    f'shoal_collectives_waiting_for_rank_since_timestamp_seconds'
                    f'{{run_id="{run_id}"}} == 0 or absent(shoal_collectives_waiting_for_rank_'
                    f'since_timestamp_seconds{{run_id="{run_id}"}})', 20)
            finally:
                stop.touch()
            assert run.wait(60) == 0, run.tail()


def test_an_agent_killed_mid_run_fires_agent_down(tmp_path):
    """The fault ShoalAgentDown is for: an agent that vanished while its workers ran (its
    process group SIGKILLed, workers with it)."""
    require_prometheus()
    run, _ = _job(tmp_path, "killed")
    with run:
        port = int(run.wait_for(METRICS_LINE, 30).group(1))
        target = f"127.0.0.1:{port}"
        with PrometheusServer([target], rules=_rules(tmp_path, 600)) as prom:
            prom.wait_for_series('shoal_training_last_step{run_id="killed"} > 3', 60)
            assert prom.alerts(state=None) == []
            run.kill()
            (down,) = prom.wait_for_alert("ShoalAgentDown", 15)
            assert down["labels"]["instance"] == target, down
