"""The flight-recorder dump: one JSON file of a rank's recent operations, written when its group
fails, under SHOAL_DUMP_DIR as `shoal-collectives-<group>-rank<r>-pid<pid>-<time>-<n>.json`.

The elastic agent reads these files to blame the rank that hung (elastic/agent/hang_blame.py):
it relies on "pid", "global_rank", "group", "reason", "failed_op" (with "seq" and "p2p") and
"progress_of_ranks" (rank -> [last started seq, last finished seq]). Change them in both places.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
from typing import Optional

from shoal.collectives import env
from shoal.collectives.backends.api import WatchedGroup
from shoal.collectives.backends.ledger import OpRecord
from shoal.collectives.backends.progress import RankProgress

logger = logging.getLogger(__name__)

__all__ = ["write_dump"]

_dump_ids = itertools.count(1)


def write_dump(group: WatchedGroup, reason: str, record: Optional[OpRecord] = None,
               progress: Optional[dict[int, RankProgress]] = None) -> Optional[str]:
    """Write this rank's recent operations as JSON; returns the file's path (None on failure).

    `record` is the operation that failed, `progress` the other ranks' progress read for it.
    """
    ledger = group.ledger
    doc = {
        "group": group.name,
        "rank": group.rank(),
        "global_rank": group.global_rank,
        "world_size": group.size(),
        "backend": group.backend_name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "reason": reason,
        "timeout_s": group.timeout,
        "failed_op": record.as_dict() if record is not None else None,
        "last_started_seq": ledger.started_seq,
        "last_finished_seq": ledger.finished_seq,
        "progress_of_ranks": None if progress is None else {
            str(q): [p.started, p.finished] for q, p in progress.items()},
        "calls_of_ranks": None if progress is None else {
            str(q): p.call for q, p in progress.items()},
        "entries": [r.as_dict() for r in list(ledger.history)],
    }
    directory = env.dump_dir()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe_group = "".join(c if c.isalnum() or c in "-_" else "_" for c in group.name)
    # Two threads of one rank may dump at once (its own timeout and a peer's relayed one).
    path = os.path.join(
        directory,
        f"shoal-collectives-{safe_group}-rank{group.rank()}-pid{os.getpid()}-{stamp}-"
        f"{next(_dump_ids)}.json",
    )
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        logger.error("Rank %d of group %r could not write its collectives dump to %s: %s",
                     group.rank(), group.name, path, exc)
        return None
