"""Failure reporting: which of a node's failed workers caused the failure, and the record of it
that the summary, the error files and the store carry.

A worker that exited with the collectives' async-error code only saw a peer fail; a collective
timeout behind it is blamed on the hung rank its watchdog dump names (`hang_blame`), not on the
worker that noticed.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping, Optional, Sequence

from shoal.elastic.agent.hang_blame import Hang, find_hang
from shoal.elastic.agent.spec import PEER_FAILURE_EXIT_CODES
from shoal.elastic.agent.workers import WorkerExit, WorkerGroup, describe_exit
from shoal.elastic.errors import error_document, read_error_file, write_error_file

logger = logging.getLogger(__name__)


def is_peer_failure(failure: WorkerExit) -> bool:
    """The worker ended because a peer failed (its watchdog aborted), not by its own fault."""
    return failure.exitcode in PEER_FAILURE_EXIT_CODES


def ordered(failures: Sequence[WorkerExit]) -> list[WorkerExit]:
    """`failures`, the likeliest cause first: own failures before peer ones, then by time."""
    return sorted(failures, key=lambda f: (is_peer_failure(f), f.time))


def settle(group: WorkerGroup, *, wait: float, interval: float, single_node: bool,
           cause_found: Callable[[], bool]) -> list[WorkerExit]:
    """This node's failed workers, the likeliest cause first.

    If every failure is only a peer's, the cause is elsewhere: a local worker whose exit is not
    reaped yet (milliseconds), or another node, which claims the round as soon as it sees its
    own failure, or which died (its heartbeat lapses). Wait up to `wait` seconds for one of
    those (`cause_found` says when another node did), so the summary names the real cause and
    a lost node costs no restart.
    """
    failures = group.failures()
    if not all(is_peer_failure(f) for f in failures):
        return ordered(failures)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        group.changed.wait(interval)
        group.changed.clear()
        failures = group.failures()
        if not all(is_peer_failure(f) for f in failures):
            break
        if single_node:
            if group.counts()["running"] == 0:
                break  # every local worker is accounted for
            continue
        if cause_found():
            break
    return ordered(failures)


# Worker errors a restart would only repeat (elastic.checkpoint_files.CheckpointDiskError: a
# checkpoint save the disk refused), by the class name an error file's message starts with.
NOT_RETRYABLE_ERRORS = ("CheckpointDiskError",)


def not_retryable(record: Mapping) -> bool:
    """The failure record is of a fault a restart would only repeat (a full or read-only
    checkpoint disk): the job should fail at once rather than spend its restarts on it."""
    return record.get("retryable") is False


def _retryable_field(doc: Mapping, failure: WorkerExit) -> dict:
    """{"retryable": False} when the worker exited (not by a signal) after reporting a fault a
    restart would repeat: marked so in its error file, or named by its error's class."""
    if failure.exitcode is None or failure.exitcode <= 0:
        return {}
    marked = isinstance(doc.get("shoal"), dict) and doc["shoal"].get("retryable") is False
    named = doc["message"]["message"].startswith(tuple(f"{n}: " for n in NOT_RETRYABLE_ERRORS))
    return {"retryable": False} if marked or named else {}


def failure_record(round_: int, node_id: str, first: WorkerExit) -> dict:
    """The record of the failure that ends a round, as the store and the summary carry it."""
    return {
        "round": round_, "rank": first.rank, "local_rank": first.local_rank,
        "node": node_id, "pid": first.pid, "exitcode": first.exitcode,
        "exit": describe_exit(first.exitcode), "time": first.time,
        "tail": list(first.tail), "log_path": first.log_path,
    }


def error_file_fields(path: Optional[str], failure: WorkerExit) -> dict:
    """The failure record's error fields: the worker's own error file (torch's @record,
    shoal.elastic.errors.record), else one written here for it from its exit."""
    if path is None:
        return {}
    doc = read_error_file(path)
    if doc is None:
        doc = error_document(
            f"rank {failure.rank} (pid {failure.pid}) ended with "
            f"{describe_exit(failure.exitcode)} and wrote no error file",
            "\n".join(failure.tail), {"rank": failure.rank, "exitcode": failure.exitcode})
        try:
            write_error_file(path, doc)
        except OSError as exc:
            logger.warning("Cannot write rank %s's error file %s: %s", failure.rank, path, exc)
            return {}
        return {"error_file": path}
    message = doc["message"]
    return {"error_file": path, "error": message["message"],
            "traceback": message.get("extraInfo", {}).get("py_callstack", ""),
            **_retryable_field(doc, failure)}


def hang_behind(failures: Sequence[WorkerExit],
                dump_dir: str) -> tuple[Optional[Hang], Optional[WorkerExit]]:
    """A collective timeout behind these failures, from the watchdog dumps, and the worker
    whose dump names it (the rank that noticed); (None, None) without one."""
    for failure in failures:
        if is_peer_failure(failure):
            hang = find_hang(failure.pid, dump_dir)
            if hang is not None:
                return hang, failure
    return None, None


def blame(hang: Hang, detector: WorkerExit, rank_nodes: Mapping[int, str],
          group: Optional[WorkerGroup]) -> dict:
    """The failure record's fields that point at the hung rank instead of the detector."""
    fields = {"hang": hang.reason, "detected_by": detector.rank,
              "dump_path": hang.dump_path, "culprits": list(hang.culprits)}
    if hang.group != "default":
        return fields  # group ranks: the record keeps the detector as the rank
    rank = hang.culprits[0]
    fields.update(rank=rank, node=rank_nodes.get(rank, "?"), local_rank="?", pid="?")
    if group is not None and rank in group.ranks:
        local = group.ranks.index(rank)
        fields.update(local_rank=local, pid=group.pids[local])
    return fields


def restart_reason(hang: Optional[Hang], noticer: Optional[WorkerExit], first: WorkerExit,
                   node_id: str) -> str:
    """Why the job restarts, as the other nodes read it."""
    if hang is not None and noticer is not None:
        return (f"{hang.culprit_names()} hung: rank {noticer.rank} on node {node_id} timed out "
                "waiting for it")
    return f"rank {first.rank} on node {node_id} ended with {describe_exit(first.exitcode)}"


def settle_wait(single_node: bool, heartbeat_timeout: float) -> float:
    """How long to wait for the real cause when only peer failures are seen: a second on one
    node, else long enough for a dead node's heartbeat to lapse."""
    return 1.0 if single_node else heartbeat_timeout + 1.0


