"""A real Prometheus scrapes a `shoal run` agent and sees the agent's shoal_elastic_* series
and its workers' shoal_collectives_* series (prometheus_client multiprocess mode)."""

import os

from tests.support.prometheus_server import PrometheusServer
from tests.support.shoal_run import WORKERS, ShoalRun


def test_prometheus_scrapes_the_agent_and_its_workers(tmp_path):
    stop = tmp_path / "stop"
    args = ["--nproc-per-node", "2", "--metrics-port", "0",
            str(WORKERS / "metrics_worker.py"), "--stop-file", str(stop)]
    with ShoalRun(args, name="job") as run:
        port = int(run.wait_for(r"Metrics of this node's agent and workers at "
                                r"http://127\.0\.0\.1:(\d+)/metrics", 30).group(1))
        run.wait_for(r"\[rank 1\] rank 1 did 5 allreduces: 32;", 30)
        multiproc_dir = run.wait_for(r"\[rank 0\] rank 0 did 5 allreduces: 32; metrics in (\S+)",
                                     30).group(1)
        assert os.path.isdir(multiproc_dir)
        with PrometheusServer([f"127.0.0.1:{port}"]) as prom:
            workers = prom.wait_for_series('shoal_elastic_workers{state="running"}', 30)
            assert float(workers[0]["value"][1]) == 2
            restarts = prom.wait_for_series("shoal_elastic_restarts_total", 10)
            assert {r["metric"]["reason"] for r in restarts} >= {"worker_failure", "scale_up"}
            assert prom.wait_for_series("shoal_elastic_rendezvous_round", 10)
            assert prom.wait_for_series("shoal_elastic_rendezvous_duration_seconds_count", 10)
            # The workers' series, summed across both worker processes: 5 allreduces each.
            ops = prom.wait_for_series(
                'sum(shoal_collectives_op_duration_seconds_count{op="all_reduce"})', 30)
            assert float(ops[0]["value"][1]) >= 10
            assert prom.wait_for_series("shoal_collectives_bytes_total", 10)
        stop.touch()
        assert run.wait(60) == 0, run.tail()
    assert not os.path.exists(multiproc_dir)  # the job's metrics files are cleaned up
