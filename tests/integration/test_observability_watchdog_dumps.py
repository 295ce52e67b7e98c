"""A real collective hang is counted on the agent's /metrics: rank 1 of a `shoal run
--collective-timeout 3` job is SIGSTOPped inside its all-reduce loop, rank 0's watchdog gives
up after 3 s and writes a dump into SHOAL_DUMP_DIR, and the agent restarts the job. A scraper
polling the agent's endpoint the whole time sees shoal_elastic_dumps go from 0 to the number
of dump files the job wrote, and the watchdog's timeout counted."""

from __future__ import annotations

import os
import re
import signal
import threading
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.shoal_run import WORKERS, ShoalRun

LOOP = str(WORKERS / "allreduce_loop.py")
METRICS_AT = r"Metrics of this node's agent and workers at (http://127\.0\.0\.1:\d+/metrics)"
DUMP_NAME = re.compile(r"shoal-collectives-.*-pid\d+-.*\.json")


class _Scraper(threading.Thread):
    """Scrapes `url` every 0.2 s until told to stop or the endpoint goes away; keeps, per scrape,
    the dumps gauge and the summed collective timeouts."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.readings: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as reply:
                    text = reply.read().decode()
            except (urllib.error.URLError, OSError):
                return  # the agent exited (after its last scrape)
            dumps = timeouts = 0.0
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "shoal_elastic_dumps":
                        dumps = s.value
                    elif s.name == "shoal_collectives_timeouts_total":
                        timeouts += s.value
            self.readings.append((dumps, timeouts))
            self.halt.wait(0.2)


def test_a_hung_collective_writes_a_dump_that_the_agent_counts(tmp_path):
    dumps = tmp_path / "dumps"
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--collective-timeout", "3", "--grace-period", "1", "--metrics-port", "0", LOOP]
    with ShoalRun(args, env={"SHOAL_DUMP_DIR": str(dumps)}, name="job") as run:
        scraper = _Scraper(run.wait_for(METRICS_AT, 30).group(1))
        pids = run.worker_pids(30)
        run.wait_for(r"rank 1 step 5 ", 30)
        scraper.start()
        try:
            while not scraper.readings and scraper.is_alive():
                scraper.halt.wait(0.05)
            os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs; rank 0's all_reduce waits for it
            run.wait_for(r"rank 1 group timeout 3s \(restart 1\)", 40)
            code = run.wait(40)
        finally:
            scraper.halt.set()
            try:
                os.kill(pids[1], signal.SIGKILL)
            except ProcessLookupError:
                pass
        scraper.join(10)
    assert code == 0, run.tail()
    written = [name for name in os.listdir(dumps) if DUMP_NAME.fullmatch(name)]
    assert written, f"no watchdog dump in {dumps}: {os.listdir(dumps)}\n{run.tail()}"
    readings = scraper.readings
    assert readings[0] == (0.0, 0.0), readings
    # The agent's metrics server waits for the scraper's next scrape before it exits, so the
    # last reading comes after everything the job wrote.
    final_dumps, final_timeouts = readings[-1]
    assert final_dumps == len(written), (readings[-5:], written)
    assert final_timeouts >= 1, readings[-5:]
