"""Writes shoal-dashboard.json: `python deploy/grafana/make_dashboard.py` (no arguments).

Each panel answers one operator question (its title). Every query selects by the `run_id`
label that the node agent puts on every sample it serves (no scrape relabel rule needed, so a
PodMonitor or an annotation-based scrape works the same), windows are `$__rate_interval`, and
the rank selector narrows the per-rank panels. tests/integration/test_observability_dashboard.py
runs every expression against a live job under a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path

RUN = 'run_id=~"$run"'
RANK = 'run_id=~"$run", rank=~"$rank"'
RI = "$__rate_interval"
# Mean step time per rank.
STEP_TIME_BY_RANK = (f"sum by (rank) (rate(shoal_training_step_seconds_sum{{{RANK}}}[{RI}])) / "
                     f"sum by (rank) (rate(shoal_training_step_seconds_count{{{RANK}}}[{RI}]))")
# Per rank, the seconds of each step it spent not waiting inside collectives: its own work
# (compute, data loading, checkpoints). Ranks that synchronise inside the step (DDP's gradient
# all-reduce) all take the slowest rank's step time, so step time cannot name the straggler;
# this can, as a series and as the straggler heatmap.
WORK_PER_STEP_BY_RANK = (
    f"clamp_min(1 - sum by (rank) (rate(shoal_collectives_wait_seconds_total{{{RANK}}}[{RI}])), 0)"
    f" / sum by (rank) (rate(shoal_training_step_seconds_count{{{RANK}}}[{RI}]))")
WAIT_SHARE_BY_RANK = (
    f"sum by (rank) (rate(shoal_collectives_wait_seconds_total{{{RUN}}}[{RI}]))")
# A straggler is named only when some rank waits this much more of its time inside collectives
# than the one that waits least (0.1: 10% of wall time, as `shoal top`'s mark): ranks of equal
# work differ by noise, and naming one of them would send people after nothing.
STRAGGLER_MIN_WAIT_GAP = 0.1
STRAGGLER = (f"bottomk(1, {WAIT_SHARE_BY_RANK}) and on () "
             f"(max({WAIT_SHARE_BY_RANK}) - min({WAIT_SHARE_BY_RANK}) > {STRAGGLER_MIN_WAIT_GAP})")
WAITING_FOR = "shoal_collectives_waiting_for_rank_since_timestamp_seconds"
IN_COLLECTIVE = "shoal_collectives_in_collective_since_timestamp_seconds"
DS = {"type": "prometheus", "uid": "${datasource}"}


def _targets(queries):
    return [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (expr, legend) in enumerate(queries)]


def panel(kind, title, description, queries, unit="short", w=6, h=6, **extra):
    out = {"type": kind, "title": title, "description": description, "datasource": DS,
           "targets": _targets(queries), "gridPos": {"w": w, "h": h},
           "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}}
    out.update(extra)
    return out


def stat(title, description, expr, unit="short", legend="", no_value=None, **extra):
    out = panel("stat", title, description, [(expr, legend)], unit, w=4, h=4,
                options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
                **extra)
    if no_value is not None:  # what an empty answer means, instead of Grafana's "No data"
        out["fieldConfig"]["defaults"]["noValue"] = no_value
    return out


def series(title, description, queries, unit="short", w=12, **extra):
    return panel("timeseries", title, description, queries, unit, w=w, h=8, **extra)


def row(title):
    return {"type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"w": 24, "h": 1}}


PANELS = [
    row("Job: is it healthy?"),
    stat("Nodes reporting", "Node agents of this run that Prometheus scrapes now "
         "(compare with nnodes of shoal_job_info).",
         f"count by (run_id) (shoal_job_info{{{RUN}}})"),
    stat("Workers running", "Worker processes running now (the world size while healthy).",
         f"sum by (run_id) (shoal_elastic_workers{{{RUN}, state=\"running\"}})"),
    stat("Restarts used", "Restarts after worker failures the job used (of max_restarts).",
         f"max by (run_id) (shoal_elastic_job_restarts{{{RUN}}})"),
    stat("Restarts left", "max_restarts minus the restarts used: at 0 the next failure ends "
         "the job.",
         f"max by (run_id) (shoal_elastic_max_restarts{{{RUN}}}) - "
         f"max by (run_id) (shoal_elastic_job_restarts{{{RUN}}})"),
    stat("Worker failures", "Worker processes that failed since the agents started (exit not "
         "0 and not caused by the agent; peers aborted by their watchdog count apart).",
         f"sum by (run_id) (shoal_elastic_worker_exits_total{{{RUN}, state=\"failed\"}})"),
    stat("Since the last restart", "Time since any agent of this run last restarted its "
         "workers (empty: never).",
         f"time() - max by (run_id) (shoal_elastic_last_restart_timestamp_seconds{{{RUN}}} > 0)",
         unit="s"),
    series("Restarts so far, by reason", "Whole counts: a step up is one restart.",
           [(f"sum by (reason) (shoal_elastic_restarts_total{{{RUN}}})", "{{reason}}")]),
    series("Workers by state, per node", "Worker processes of each node agent by state.",
           [(f"sum by (instance, state) (shoal_elastic_workers{{{RUN}}})",
             "{{instance}} {{state}}")]),
    series("How long did the last rendezvous take?", "Per node, the last round's rendezvous "
           "(a gauge: no quantile of an empty window).",
           [(f"max by (instance) (shoal_elastic_rendezvous_last_duration_seconds{{{RUN}}})",
             "{{instance}}")], unit="s"),
    series("Worker exits by how", "Worker processes that ended since the agents started.",
           [(f"sum by (state) (shoal_elastic_worker_exits_total{{{RUN}}})", "{{state}}")]),

    row("Training (shoal.metrics): is it progressing, and who is slow?"),
    series("Loss", "The last recorded loss of each rank.",
           [(f"max by (rank) (shoal_training_loss{{{RANK}}})", "rank {{rank}}")]),
    series("Samples per second, per rank", "",
           [(f"sum by (rank) (rate(shoal_training_samples_total{{{RANK}}}[{RI}]))",
             "rank {{rank}}")], unit="ops"),
    series("Step time, per rank", "Mean wall time of a step. Ranks that synchronise inside "
           "the step (DDP) all take the slowest rank's time: the next panel names the slow one.",
           [(STEP_TIME_BY_RANK, "rank {{rank}}")], unit="s"),
    series("Work per step, per rank: who holds the others up?", "Seconds of each step a rank "
           "spent not waiting in collectives (compute, data loading, checkpoints); the "
           "straggler's line is the highest.",
           [(WORK_PER_STEP_BY_RANK, "rank {{rank}}")], unit="s"),
    panel("heatmap", "Straggler heatmap: work per step by rank over time", "One row per rank, "
          "the time of each step it did not wait for others; the slow rank's row stands out.",
          [(WORK_PER_STEP_BY_RANK, "{{rank}}")], unit="s", w=12, h=8,
          options={"calculate": False, "yAxis": {"unit": "short"},
                   "rowsFrame": {"layout": "auto"}}),
    stat("Which rank is the straggler?", "The rank that spends the least time waiting in "
         "collectives (in a synchronous job the others wait for it), named only when another "
         f"rank waits at least {STRAGGLER_MIN_WAIT_GAP:.0%} more of its time: "
         "\"none\" otherwise.", STRAGGLER, unit="percentunit", legend="rank {{rank}}",
         no_value="none"),
    stat("Which rank do the others wait for?", "A rank that other ranks have waited for "
         "inside a collective for over a second (it never arrived, or did not finish), and for "
         "how long: the hung rank. \"nobody\" while no collective waits that long.",
         f"max by (peer) (time() - ({WAITING_FOR}{{{RUN}}} > 0))", unit="s",
         legend="rank {{peer}}", no_value="nobody"),
    series("Inside one collective for, per rank", "How long each rank has been inside its "
           "current collective, once that is over a second (0 otherwise): a rank stuck "
           "outside collectives stays at 0 while the others climb.",
           [(f"(time() - max by (rank) ({IN_COLLECTIVE}{{{RANK}}} > 0)) "
             f"or (max by (rank) ({IN_COLLECTIVE}{{{RANK}}}) * 0)", "rank {{rank}}")], unit="s"),
    series("Time waiting in collectives, per rank", "Seconds per second inside collectives.",
           [(f"sum by (rank) (rate(shoal_collectives_wait_seconds_total{{{RANK}}}[{RI}]))",
             "rank {{rank}}")], unit="percentunit"),
    series("Since the last step, per rank", "Seconds since each rank recorded a step "
           "(a rising line: no progress).",
           [(f"time() - max by (rank) (shoal_training_last_step_timestamp_seconds{{{RANK}}})",
             "rank {{rank}}")], unit="s"),
    series("Since the last collective, per rank", "Seconds since each rank's last collective "
           "completed.",
           [(f"time() - max by (rank) (shoal_collectives_last_op_timestamp_seconds{{{RANK}}})",
             "rank {{rank}}")], unit="s"),
    series("Last step, per rank", "",
           [(f"max by (rank) (shoal_training_last_step{{{RANK}}})", "rank {{rank}}")]),

    row("Checkpoints: what would a failure lose?"),
    stat("Since the last checkpoint", "Age of the newest usable checkpoint (empty: the run "
         "has not checkpointed).", f"time() - max by (run_id) "
         f"(shoal_checkpoint_last_save_timestamp_seconds{{{RUN}}} > 0)", unit="s"),
    stat("Steps a failure would lose", "Last step minus the last checkpointed step.",
         f"min by (run_id) (shoal_training_last_step{{{RUN}}}) - "
         f"max by (run_id) (shoal_checkpoint_last_step{{{RUN}}})"),
    series("How long did the last checkpoint save and load take?", "Per operation (a gauge: "
           "a window without a load is not NaN).",
           [(f"max by (operation) (shoal_checkpoint_last_duration_seconds{{{RUN}}})",
             "{{operation}}")], unit="s", w=8),
    series("Checkpoint bytes per second", "",
           [(f"sum by (operation) (rate(shoal_checkpoint_bytes_total{{{RUN}}}[{RI}]))",
             "{{operation}}")], unit="Bps", w=8),

    row("Workers' resources"),
    series("Resident memory, per rank", "From /proc of each worker, read by its agent.",
           [(f"max by (rank) (shoal_worker_resident_memory_bytes{{{RANK}}})", "rank {{rank}}")],
           unit="bytes"),
    series("CPU, per rank", "Cores used by each worker process.",
           [(f"sum by (rank) (rate(shoal_worker_cpu_seconds_total{{{RANK}}}[{RI}]))",
             "rank {{rank}}")], unit="percentunit"),

    row("Collectives"),
    stat("Watchdog dumps", "Collective watchdog dumps the job's workers wrote (a hang or a "
         "timeout; the files in SHOAL_DUMP_DIR name the ranks).",
         f"sum by (run_id) (shoal_elastic_dumps{{{RUN}}})"),
    series("Collective latency p99, by op", "",
           [(f"histogram_quantile(0.99, sum by (le, op) "
             f"(rate(shoal_collectives_op_duration_seconds_bucket{{{RUN}}}[{RI}]))) "
             # An op idle in the window has no quantile (NaN): leave it out.
             f"and on (op) (sum by (op) "
             f"(rate(shoal_collectives_op_duration_seconds_count{{{RUN}}}[{RI}])) > 0)", "{{op}}")],
           unit="s"),
    series("Collectives per second, by op", "",
           [(f"sum by (op) (rate(shoal_collectives_op_duration_seconds_count{{{RUN}}}[{RI}]))",
             "{{op}}")], unit="ops"),
    series("Bytes into collectives per second, by op", "",
           [(f"sum by (op) (rate(shoal_collectives_bytes_total{{{RUN}}}[{RI}]))", "{{op}}")],
           unit="Bps"),
    series("Are collectives failing?", "Errors by kind and watchdog timeouts (the series "
           "exist at 0, so the first one shows).",
           [(f"sum by (kind) (increase(shoal_collectives_errors_total{{{RUN}}}[{RI}]))",
             "error {{kind}}"),
            (f"sum (increase(shoal_collectives_timeouts_total{{{RUN}}}[{RI}]))", "timeout")]),

    row("DistributedDataParallel"),
    series("Is gradient communication hidden behind backward?", "Mean time the end of "
           "backward waits for communication.",
           [(f"sum(rate(shoal_ddp_comm_wait_seconds_sum{{{RUN}}}[{RI}])) / "
             f"sum(rate(shoal_ddp_comm_wait_seconds_count{{{RUN}}}[{RI}]))", "wait")],
           unit="s"),
    series("Bucket allreduce time", "Mean time from launching a bucket's reduction to its "
           "completion.",
           [(f"sum(rate(shoal_ddp_bucket_allreduce_seconds_sum{{{RUN}}}[{RI}])) / "
             f"sum(rate(shoal_ddp_bucket_allreduce_seconds_count{{{RUN}}}[{RI}]))", "bucket")],
           unit="s"),

    row("RPC"),
    series("RPC requests per second, by kind and outcome", "",
           [(f"sum by (kind, status) (rate(shoal_rpc_requests_total{{{RUN}}}[{RI}]))",
             "{{kind}} {{status}}")], unit="reqps", w=8),
    series("RPC latency p99, by kind", "",
           [(f"histogram_quantile(0.99, sum by (le, kind) "
             f"(rate(shoal_rpc_latency_seconds_bucket{{{RUN}}}[{RI}]))) and on (kind) "
             f"(sum by (kind) (rate(shoal_rpc_latency_seconds_count{{{RUN}}}[{RI}])) > 0)",
             "{{kind}}")],
           unit="s", w=8),
    series("Is someone knocking with a wrong token?", "Connections and messages refused "
           "before anything was unpickled (authentication failures), by port.",
           [(f"sum by (port) (increase(shoal_rpc_rejected_total{{{RUN}}}[{RI}]))", "{{port}}")],
           w=8),
    series("RPC calls in flight", "",
           [(f"sum(shoal_rpc_inflight{{{RUN}}})", "in flight")], w=8),
    series("RPC bytes per second, by direction", "",
           [(f"sum by (direction) (rate(shoal_rpc_bytes_total{{{RUN}}}[{RI}]))",
             "{{direction}}")], unit="Bps", w=8),
    series("RPC receive cache", "Bytes kept for reuse by large received buffers, per node.",
           [(f"sum by (instance) (shoal_rpc_receive_cache_bytes{{{RUN}}})", "{{instance}}")],
           unit="bytes", w=8),
]


def _layout(panels):
    """Grafana wants ids and positions: fill rows left to right, 24 columns wide."""
    x = y = row_height = 0
    for number, p in enumerate(panels, 1):
        p["id"] = number
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if p["type"] == "row" or x + w > 24:
            x, y = 0, y + row_height
            row_height = 0
        p["gridPos"].update(x=x, y=y)
        x += w
        row_height = max(row_height, h)
        if p["type"] == "row":
            x, y, row_height = 0, y + h, 0
    return panels


def dashboard() -> dict:
    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0},
        {"name": "run", "label": "Run", "type": "query", "datasource": DS,
         "query": {"query": "label_values(shoal_job_info, run_id)", "refId": "run"},
         "definition": "label_values(shoal_job_info, run_id)", "includeAll": True,
         "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "hide": 0},
        {"name": "rank", "label": "Rank", "type": "query", "datasource": DS,
         "query": {"query": 'label_values(shoal_collectives_last_op_timestamp_seconds'
                            '{run_id=~"$run"}, rank)', "refId": "rank"},
         "definition": 'label_values(shoal_collectives_last_op_timestamp_seconds'
                       '{run_id=~"$run"}, rank)', "includeAll": True, "multi": True,
         "allValue": ".*", "current": {}, "refresh": 2, "hide": 0, "sort": 3},
    ]
    return {
        "title": "shoal: distributed training", "uid": "shoal-overview",
        "description": "A shoal run: health and restarts, training progress and stragglers, "
                       "checkpoints, workers' resources, collectives, DDP and RPC.",
        "tags": ["shoal", "distributed-training"], "timezone": "browser",
        "schemaVersion": 39, "version": 2, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "annotations": {"list": []},
        "templating": {"list": variables}, "panels": _layout(PANELS),
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("shoal-dashboard.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
