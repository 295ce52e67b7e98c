"""Letting a killed worker's peers count its loss before the agent stops them.

A worker killed by a signal says no goodbye: each peer's process group sees the connection close
and counts a PeerLost in `shoal_collectives_errors_total` (collectives.metrics), from a thread of
its own, whether or not a collective is running. The agent reaps the dead worker at the same
moment and would SIGTERM the peers a millisecond later; on a busy machine that SIGTERM often
won the race and the loss was never counted (ShoalCollectiveErrors stayed silent). So before
stopping them the agent waits, briefly and with a bound, until each running peer that ever ran
a collective has counted a failure or exited.

The agent reads each peer's own multiprocess files (PROMETHEUS_MULTIPROC_DIR/counter_PID.db and
histogram_PID.db, prometheus_client's format): nothing is counted for a peer, and a peer that
never ran a collective (so has no group to fail) is not waited for. A peer whose group was
already gone (it destroyed it, or never had one with the dead rank) costs the bound once, and
the agent says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

from prometheus_client.mmap_dict import MmapedDict

from shoal.elastic.agent.workers import WorkerGroup

# A peer's group thread wakes within microseconds of the closed connection; a second covers a
# machine loaded far past its cores. Only a peer that will never count waits this long.
NOTICE_WAIT_S = 1.0
_POLL_S = 0.005
_ERRORS = "shoal_collectives_errors_total"
_OP_BUCKET = "shoal_collectives_op_duration_seconds_bucket"


@dataclasses.dataclass(frozen=True)
class Tally:
    """What one worker's metric files say: it ran a collective; the failures it counted."""

    ran_collectives: bool
    errors: float


def _samples(path: str, name: str):
    """Values of the samples named `name` in one multiprocess file (none if it is absent)."""
    quoted = json.dumps(name)
    try:
        entries = list(MmapedDict.read_all_values_from_file(path))
    except (OSError, RuntimeError, ValueError):  # absent, or caught mid-write: read again later
        return []
    return [value for key, value, _, _ in entries if quoted in key
            and json.loads(key)[1] == name]


def read_tally(multiproc_dir: str, pid: int) -> Tally:
    """The tally of worker `pid` from its files in `multiproc_dir`."""
    buckets = _samples(os.path.join(multiproc_dir, f"histogram_{pid}.db"), _OP_BUCKET)
    errors = _samples(os.path.join(multiproc_dir, f"counter_{pid}.db"), _ERRORS)
    return Tally(ran_collectives=any(v > 0 for v in buckets), errors=sum(errors))


def wait_until_counted(group: WorkerGroup, multiproc_dir: Optional[str],
                       timeout: float = NOTICE_WAIT_S) -> list[int]:
    """Wait up to `timeout` seconds until every running worker of `group` that ran a
    collective has counted a failure or exited; return the ranks that did neither."""
    if not multiproc_dir:
        return []
    deadline = time.monotonic() + timeout
    while True:
        waiting = [rank for rank, pid in group.running()
                   if (tally := read_tally(multiproc_dir, pid)).ran_collectives
                   and not tally.errors]
        if not waiting or time.monotonic() >= deadline:
            return waiting
        # An exit wakes this at once. The round is ending: nothing else waits on `changed` now,
        # and clearing it keeps a second exit from turning this poll into a spin.
        if group.changed.wait(_POLL_S):
            group.changed.clear()
