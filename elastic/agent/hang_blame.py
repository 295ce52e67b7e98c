"""Find the rank that hung when a worker ended because *its* collective timed out.

The rank whose watchdog fires is the one that noticed the hang (it exits with the collectives'
async-error code, 75), not the one that caused it: that one is often still alive, stopped or
stuck. The watchdog names the culprits in the `CollectiveTimeout` it raises and records the
evidence in a JSON dump (`collectives.backends.dump`, which describes the format): the overdue
op's sequence number and every rank's published progress. The agent points SHOAL_DUMP_DIR of
its workers at a known directory and reads the dump of the worker that exited, by its pid, so
the summary can blame the rank that never arrived. The dump is structured data, so no log
line is parsed.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "default"


@dataclasses.dataclass(frozen=True)
class Hang:
    """A collective timeout seen by `detector`: `culprits` never arrived or never finished."""

    detector: Optional[int]   # the global rank whose watchdog fired; None: the dump lacks it
    culprits: tuple[int, ...]  # group ranks (global ranks when group == "default")
    group: str
    reason: str               # the watchdog's own sentence
    dump_path: str

    def detector_name(self) -> str:
        """'rank 0', or what an unknown detector means (never a made-up rank such as -1)."""
        if self.detector is None:
            return f"a rank whose dump did not say which ({self.dump_path})"
        return f"rank {self.detector}"

    def culprit_names(self) -> str:
        """'rank 1' / 'ranks 1, 3' (of group 'g' for a subgroup)."""
        word = "rank" if len(self.culprits) == 1 else "ranks"
        names = f"{word} {', '.join(map(str, self.culprits))}"
        return names if self.group == DEFAULT_GROUP else f"{names} of group {self.group!r}"


def culprits_from_dump(doc: dict) -> tuple[int, ...]:
    """The ranks behind a timeout dump: those that never started the overdue op, else those
    that never finished it (the watchdog's own rule); () when the dump cannot tell."""
    op = doc.get("failed_op") or {}
    progress = doc.get("progress_of_ranks")
    if op.get("p2p") or not isinstance(progress, dict) or not isinstance(op.get("seq"), int):
        return ()
    seq = op["seq"]
    try:
        marks = {int(rank): (int(v[0]), int(v[1])) for rank, v in progress.items()}
    except (TypeError, ValueError, IndexError):
        return ()
    missing = sorted(r for r, (started, _) in marks.items() if started < seq)
    if missing:
        return tuple(missing)
    return tuple(sorted(r for r, (_, finished) in marks.items() if finished < seq))


def find_hang(pid: int, dump_dir: Optional[str]) -> Optional[Hang]:
    """The newest timeout dump written by process `pid` in `dump_dir` that names culprits."""
    if not dump_dir:
        return None
    paths = glob.glob(os.path.join(glob.escape(dump_dir), f"shoal-collectives-*-pid{pid}-*.json"))
    for path in sorted(paths, key=_mtime, reverse=True):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            logger.debug("Cannot read the collectives dump %s: %s", path, exc)
            continue
        if not isinstance(doc, dict) or doc.get("pid") != pid:
            continue
        culprits = culprits_from_dump(doc)
        if culprits:
            return Hang(detector=_rank_in(doc), culprits=culprits, group=str(doc.get("group", DEFAULT_GROUP)),
                        reason=str(doc.get("reason", "")), dump_path=path)
    return None


def _rank_in(doc: dict) -> Optional[int]:
    """The global rank a dump says it was written by, or None when it does not say (a dump
    of an older or foreign writer): no placeholder rank, which a reader would take as real."""
    for key in ("global_rank", "rank"):
        value = doc.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
