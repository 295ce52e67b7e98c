"""The agent's /metrics pieces on their own: /proc readings against the kernel's other reports,
run_id on every served sample, worker memory/CPU per rank, exit classification, pre-created
error and restart series, the final-scrape linger, and shoal.metrics' checks."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import shoal.metrics as sm
from shoal.elastic import training_metrics as tm
from shoal.collectives import metrics as collective_metrics
from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE
from shoal.elastic import metrics


def _scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _vm_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def test_read_proc_agrees_with_getrusage_and_status():
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn some CPU so there is something to read
        sum(range(1000))
    cpu, rss = metrics.read_proc(os.getpid())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # /proc/PID/stat counts in clock ticks; getrusage in microseconds: within a few ticks.
    assert abs(cpu - (usage.ru_utime + usage.ru_stime)) < 0.1
    assert abs(rss - _vm_rss_bytes(os.getpid())) < 2 * 1024 * 1024


def test_read_proc_of_a_process_that_is_gone_is_none():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert metrics.read_proc(proc.pid) is None


@pytest.mark.parametrize("code, stopped, state", [
    (0, False, "succeeded"), (1, False, "failed"), (-9, False, "failed"),
    (ASYNC_ERROR_EXIT_CODE, False, "aborted"), (1, True, "stopped"), (0, True, "stopped"),
])
def test_exit_states(code, stopped, state):
    assert metrics.exit_state(code, stopped) == state


def test_served_samples_carry_the_run_id_and_per_rank_worker_readings(tmp_path):
    multiproc = tmp_path / "mp"
    multiproc.mkdir()
    # A worker process that writes a multiprocess counter file and stays up.
    worker = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from shoal.collectives import metrics as m\n"
         "m.observe('all_reduce', 'tcp', 0.5, 64)\n"
         "print('ready', flush=True)\n"
         "sys.stdin.read()\n"],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc), "RANK": "3"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    server = None
    try:
        assert worker.stdout.readline().strip() == "ready"
        metrics.set_job("unit-run", world_size=4, nnodes=2, max_restarts=5, restarts_used=1)
        metrics.set_worker_pids({3: worker.pid})
        server = metrics.MetricsServer("127.0.0.1", 0, str(multiproc))
        samples = _scrape(server.url)
        assert samples, "nothing served"
        assert all(dict(labels).get("run_id") == "unit-run" for _, labels in samples)
        run = ("run_id", "unit-run")
        info = (("max_restarts", "5"), ("nnodes", "2"), run, ("world_size", "4"))
        assert samples[("shoal_job_info", info)] == 1
        assert samples[("shoal_elastic_job_restarts", (run,))] == 1
        assert samples[("shoal_elastic_max_restarts", (run,))] == 5
        rank3 = (("rank", "3"), run)
        assert samples[("shoal_collectives_wait_seconds_total", rank3)] == 0.5
        rss = samples[("shoal_worker_resident_memory_bytes", rank3)]
        assert abs(rss - _vm_rss_bytes(worker.pid)) < 2 * 1024 * 1024
        assert ("shoal_worker_cpu_seconds_total", rank3) in samples
        for state in metrics.EXIT_STATES:
            assert (("shoal_elastic_worker_exits_total", (run, ("state", state)))) in samples
        # The first error of every (op, kind) is visible to increase(): the series exist at 0.
        assert samples[("shoal_collectives_errors_total",
                        (("kind", "timeout"), ("op", "barrier"), run))] == 0
        assert not any(name.endswith("_created") for name, _ in samples)
    finally:
        worker.communicate("", timeout=10)
        metrics.set_worker_pids({})
        if server is not None:
            server.stop(linger=0)
    # A worker that ended is no longer read.
    assert metrics.read_proc(worker.pid) is None


def test_note_restart_counts_whole_restarts_and_stamps_the_time():
    child = metrics.RESTARTS.labels(reason="peer_request")
    before = child._value.get()
    t0 = time.time()
    metrics.note_restart("peer_request")
    assert child._value.get() == before + 1
    assert t0 <= metrics.LAST_RESTART._value.get() <= time.time()


def test_precreated_collective_children():
    for op in collective_metrics.OPS:
        assert (op,) in collective_metrics.TIMEOUTS._metrics
        for kind in collective_metrics.ERROR_KINDS:
            assert (op, kind) in collective_metrics.ERRORS._metrics


def _scrape_every(url: str, interval: float, stop: threading.Event) -> list[float]:
    """When each answered scrape was sent (its answer arrives a little later: the server may
    stop in between, so a scrape is placed by when it asked)."""
    times = []
    while not stop.is_set():
        sent = time.monotonic()
        try:
            urllib.request.urlopen(url, timeout=5).read()
        except OSError:
            break  # the server is gone: this scrape was not answered
        times.append(sent)
        stop.wait(interval)
    return times


def test_stop_waits_for_the_next_scrape_of_a_steady_scraper():
    server = metrics.MetricsServer("127.0.0.1", 0, None)
    halt = threading.Event()
    times: list[float] = []
    scraper = threading.Thread(target=lambda: times.extend(_scrape_every(server.url, 0.4, halt)))
    scraper.start()
    try:
        time.sleep(1.0)
        asked = time.monotonic()
        server.stop(linger=5)
        stopped = time.monotonic()
    finally:
        halt.set()
        scraper.join(10)
    after = [t for t in times if t > asked]
    # a scrape asked for after stop() was called was answered, and it was sent before stop()
    # returned (CI once saw its answer land 56 us after stop() returned: the timing was the
    # client's, not the server's)
    assert after and after[0] <= stopped, "stop() returned before the next scrape"
    assert stopped - asked < 0.4 * 1.5 + 0.5


def test_stop_is_immediate_without_a_steady_scraper():
    server = metrics.MetricsServer("127.0.0.1", 0, None)
    urllib.request.urlopen(server.url, timeout=5).read()  # one scrape: no interval known
    t0 = time.monotonic()
    server.stop(linger=5)
    assert time.monotonic() - t0 < 0.3


def test_record_step_refuses_bad_input():
    with pytest.raises(ValueError, match=r"^step must be a non-negative integer, got -1\.$"):
        sm.record_step(-1, 0.1)
    with pytest.raises(ValueError, match=r"^seconds must be >= 0, got -0\.5\.$"):
        sm.record_step(1, -0.5)
    with pytest.raises(ValueError, match=r"^samples must be >= 0, got -3\.$"):
        sm.record_step(1, 0.1, samples=-3)
    with pytest.raises(ValueError, match=r"^labelnames must not include 'rank': "
                                         r"shoal.metrics adds it\.$"):
        sm.counter("my_bad_total", "doc", ["rank"])


def test_step_records_time_samples_loss_and_heartbeat(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    count = tm.STEP_SECONDS.labels(rank="7")._sum.get()
    samples = tm.SAMPLES.labels(rank="7")._value.get()
    with sm.step(41, samples=16) as s:
        time.sleep(0.05)
        s.loss = 0.25
    assert tm.STEP_SECONDS.labels(rank="7")._sum.get() - count >= 0.05
    assert tm.SAMPLES.labels(rank="7")._value.get() - samples == 16
    assert tm.LOSS.labels(rank="7")._value.get() == 0.25
    assert tm.LAST_STEP.labels(rank="7")._value.get() == 41
    assert time.time() - tm.LAST_STEP_TIME.labels(rank="7")._value.get() < 5


def test_user_metrics_get_the_rank_label(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    plain = sm.counter("unit_user_things_total", "Things.")
    plain.inc(3)
    labelled = sm.gauge("unit_user_level", "Level.", ["kind"])
    labelled.labels(kind="a").set(5)
    with pytest.raises(AttributeError, match="call .labels"):
        labelled.set(1)
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("unit_user_things_total", {"rank": "2"}) == 3
    assert REGISTRY.get_sample_value("unit_user_level", {"rank": "2", "kind": "a"}) == 5


def test_checkpoint_helpers_record_duration_bytes_and_last_step(tmp_path):
    import numpy as np

    from shoal.elastic.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path))
    saved = tm.CHECKPOINT_BYTES.labels(operation="save")._value.get()
    loaded = tm.CHECKPOINT_BYTES.labels(operation="load")._value.get()
    path = sm.save_checkpoint(ckpt, 12, {"w": np.arange(1000.0)})
    size = os.path.getsize(path)
    assert tm.CHECKPOINT_BYTES.labels(operation="save")._value.get() - saved == size
    assert tm.CHECKPOINT_STEP._value.get() == 12
    assert time.time() - tm.CHECKPOINT_TIME._value.get() < 5
    assert tm.CHECKPOINT_LAST_SECONDS.labels(operation="save")._value.get() > 0
    step, state = sm.load_latest_checkpoint(ckpt)
    assert step == 12 and np.array_equal(state["w"], np.arange(1000.0))
    assert tm.CHECKPOINT_BYTES.labels(operation="load")._value.get() - loaded == size
    assert sm.load_latest_checkpoint(Checkpointer(str(tmp_path / "empty"))) is None


def test_dumps_of_this_agents_workers_are_counted(tmp_path):
    mine, other = 4242, 5151
    for name in (f"shoal-collectives-timeout-pid{mine}-1.json",
                 f"shoal-collectives-timeout-pid{mine}-2.json",
                 f"shoal-collectives-timeout-pid{other}-1.json",  # another job's worker
                 f"notes-pid{mine}-1.json"):                      # not a dump
        (tmp_path / name).write_text("{}")
    metrics.set_dump_dir(str(tmp_path))
    try:
        metrics.set_worker_pids({0: mine})
        metrics.set_worker_pids({})  # the worker ended: its dumps still count
        assert metrics.count_dumps() == 2
    finally:
        metrics.set_dump_dir(None)
    assert metrics.count_dumps() == 0


_RANK_WORKER = (
    "import sys\n"
    "import shoal.metrics as sm\n"
    "from shoal.collectives import metrics as m\n"
    "m.observe('all_reduce', 'tcp', 0.5, 64)\n"
    "sm.record_step(4, 0.1, samples=8, loss=0.5)\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def _start_rank(multiproc, rank: int) -> subprocess.Popen:
    """A worker process of `rank` that wrote its heartbeats, wait, step and loss, and stays up."""
    proc = subprocess.Popen([sys.executable, "-c", _RANK_WORKER],
                            env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
                                 "RANK": str(rank)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _end(proc: subprocess.Popen, rank: int, multiproc) -> None:
    """End a worker and do what the agent's reaper does for it."""
    proc.communicate("", timeout=10)
    metrics.forget_worker(rank, proc.pid)
    metrics.mark_worker_dead(proc.pid, str(multiproc))


PER_RANK = ("shoal_collectives_last_op_timestamp_seconds", "shoal_collectives_wait_seconds_total",
            "shoal_training_last_step_timestamp_seconds", "shoal_training_last_step",
            "shoal_training_loss", "shoal_training_step_seconds_count")


def _ranks(samples: dict, name: str) -> set:
    return {dict(labels)["rank"] for n, labels in samples if n == name}


def test_ranks_this_node_no_longer_runs_leave_the_scrape(tmp_path):
    # Round 0 runs ranks 2 and 3 here; after a re-rendezvous this node runs ranks 0 and 2
    # (another node order): rank 3's files stay in the directory (its counters must), but its
    # frozen heartbeat must not be served as a rank that stopped making progress.
    multiproc = tmp_path / "mp"
    multiproc.mkdir()
    server = metrics.MetricsServer("127.0.0.1", 0, str(multiproc))
    procs = {}
    try:
        procs = {rank: _start_rank(multiproc, rank) for rank in (2, 3)}
        metrics.set_worker_pids({rank: p.pid for rank, p in procs.items()})
        before = _scrape(server.url)
        for name in PER_RANK:
            assert _ranks(before, name) == {"2", "3"}, name
        for rank, proc in procs.items():
            _end(proc, rank, multiproc)

        procs = {rank: _start_rank(multiproc, rank) for rank in (0, 2)}
        metrics.set_worker_pids({rank: p.pid for rank, p in procs.items()})
        after = _scrape(server.url)
        for name in PER_RANK + ("shoal_worker_resident_memory_bytes",):
            assert _ranks(after, name) == {"0", "2"}, name
        # Rank 2's counter adds its ended process's seconds to the new one's: a restart does
        # not reset a rank's wait, and the stale rank 3 was dropped, not summed in.
        wait = {dict(labels)["rank"]: v for (n, labels), v in after.items()
                if n == "shoal_collectives_wait_seconds_total"}
        assert wait == {"0": 0.5, "2": 1.0}
        # Series without a rank label (the op histograms) still count every process.
        ops = sum(v for (n, labels), v in after.items()
                  if n == "shoal_collectives_op_duration_seconds_count")
        assert ops == 4
    finally:
        for rank, proc in procs.items():
            if proc.poll() is None:
                _end(proc, rank, multiproc)
        metrics.set_worker_pids({})
        server.stop(linger=0)


def test_a_metric_name_asked_for_again_differently_is_refused():
    from shoal.core import telemetry

    first = telemetry.counter("unit_twice_total", "Twice.", ["op"])
    assert telemetry.counter("unit_twice_total", "Twice.", ("op",)) is first
    with pytest.raises(ValueError, match=(
            r"^Metric 'unit_twice_total' exists as a Counter with labels \['op'\]; it was asked "
            r"for again as a Counter with labels \['kind'\]\. One name has one type, one set of "
            r"labels and one set of options: give the other metric a name of its own\.$")):
        telemetry.counter("unit_twice_total", "Twice.", ["kind"])
    with pytest.raises(ValueError, match=r"asked for again as a Gauge with labels \['op'\] and "
                                         r"multiprocess_mode='livesum'\."):
        telemetry.gauge("unit_twice_total", "Twice.", ["op"])
    histogram = telemetry.histogram("unit_twice_seconds", "Twice.", buckets=[0.1, 1.0])
    assert telemetry.histogram("unit_twice_seconds", "Twice.", buckets=(0.1, 1.0)) is histogram
    with pytest.raises(ValueError, match=r"exists as a Histogram with labels \[\] and "
                                         r"buckets=\(0\.1, 1\.0\); it was asked for again as a "
                                         r"Histogram with labels \[\] and buckets=\(1\.0,\)\."):
        telemetry.histogram("unit_twice_seconds", "Twice.", buckets=(1.0,))
    # Through shoal.metrics too: the rank label it adds is part of the label set.
    sm.gauge("unit_twice_level", "Level.", ["kind"])
    with pytest.raises(ValueError, match=r"^Metric 'unit_twice_level' exists as a Gauge with "
                                         r"labels \['rank', 'kind'\] and "
                                         r"multiprocess_mode='livemax'; it was asked for again "
                                         r"as a Gauge with labels \['rank'\]"):
        sm.gauge("unit_twice_level", "Level.")
