"""Each rank's progress through its collectives, as published in the store, and the diagnosis
of a timeout that reads it.

Every rank publishes, under `<group's store prefix>/progress/<rank>`, one JSON object:
`{"started": S, "finished": F, "op": OP, "call": CALL}`: the sequence numbers of the last
collective it started and finished, and while collective S runs, its op name and call
(`all_reduce(float32[1024], op=SUM)`; both "" otherwise). A rank whose collective #N is
overdue reads everyone's: a rank that has not started #N never arrived; one that started a
different call as #N called something else; one that started but has not finished #N is stuck.
The diagnosis is a pure function of the overdue record and that table, so it tests as a table.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Iterable, NamedTuple, Optional

from shoal.collectives.backends.ledger import OpLedger, OpRecord
from shoal.collectives.store.api import Store

__all__ = ["RankProgress", "Diagnosis", "progress_key", "encode", "decode", "read_all",
           "diagnose", "rank_list"]


class RankProgress(NamedTuple):
    """One rank's published progress."""

    started: int
    finished: int
    op: str = ""
    call: str = ""


NOTHING_YET = RankProgress(0, 0)


def progress_key(prefix: str, rank: int) -> str:
    """The store key of `rank`'s progress in the group whose keys start with `prefix`."""
    return f"{prefix}/progress/{rank}"


def snapshot(ledger: OpLedger) -> RankProgress:
    """What this rank publishes now."""
    started, finished, running = ledger.progress()
    if running is None:
        return RankProgress(started, finished)
    return RankProgress(started, finished, running.op, running.desc)


def encode(progress: RankProgress) -> str:
    """The JSON text stored for one rank."""
    return json.dumps(progress._asdict())


def decode(raw: bytes) -> RankProgress:
    """Inverse of `encode`; raises ValueError on anything else."""
    try:
        doc = json.loads(raw)
        return RankProgress(int(doc["started"]), int(doc["finished"]), str(doc.get("op", "")),
                            str(doc.get("call", "")))
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a progress record: {raw[:200]!r}") from exc


def read_all(store: Store, prefix: str, me: int, size: int,
             timeout: float) -> Optional[dict[int, RankProgress]]:
    """Every other rank's progress, or None if the store does not answer within `timeout`.

    The reads run in a helper thread: the store may be hosted by the very rank that hangs, and
    the watchdog must not hang with it (the thread is abandoned then).
    """
    result: dict[int, RankProgress] = {}
    failed: list[BaseException] = []

    def query() -> None:
        for q in range(size):
            if q == me:
                continue
            key = progress_key(prefix, q)
            try:
                result[q] = decode(store.get(key, timeout=1.0)) if store.check([key]) \
                    else NOTHING_YET
            except Exception as exc:  # noqa: BLE001  (any failure means "no answer")
                failed.append(exc)
                return

    thread = threading.Thread(target=query, daemon=True, name="shoal-progress-query")
    thread.start()
    thread.join(timeout)
    if thread.is_alive() or failed:
        return None
    return result


def rank_list(ranks: Iterable[int]) -> str:
    """'rank 2' or 'ranks 1, 3'."""
    ranks = list(ranks)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(map(str, ranks))}"


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Why an operation is overdue: `kind` ("timeout" or "mismatch"), a clause for the error
    message, and the ranks at fault."""

    kind: str
    clause: str
    culprits: tuple[int, ...]


def _same_call(rec: OpRecord, theirs: RankProgress) -> bool:
    if theirs.op != rec.op:
        return False
    # all_to_all's description lists every block's shape, and a rank's blocks legitimately
    # differ from another's (rank i sends what rank j receives): the op name is what must match.
    return rec.op == "all_to_all" or theirs.call == rec.desc


def diagnose(rec: OpRecord, me: int, progress: Optional[dict[int, RankProgress]],
             query_timeout: float) -> Diagnosis:
    """Why `rec` is overdue on rank `me`, from the other ranks' `progress` (None: unreadable)."""
    if rec.p2p:
        return Diagnosis("timeout", "its point-to-point peer never matched it", ())
    if progress is None:
        return Diagnosis(
            "timeout",
            "the other ranks' progress could not be read from the store (it did not answer "
            f"within {query_timeout:g}s; its host rank may be stuck)", ())
    seq = rec.seq
    other = sorted(q for q, p in progress.items() if p.started == seq and p.op
                   and not _same_call(rec, p))
    if other:
        q = other[0]
        return Diagnosis(
            "mismatch",
            f"rank {q} called {progress[q].call} as collective #{seq} but this rank called "
            f"{rec.desc}; every rank must call the same collectives in the same order with the "
            "same shapes and dtypes", (me, q))
    missing = sorted(q for q, p in progress.items() if p.started < seq)
    if missing:
        return Diagnosis("timeout", f"{rank_list(missing)} never arrived", tuple(missing))
    stuck = sorted(q for q, p in progress.items() if p.finished < seq)
    if stuck:
        return Diagnosis("timeout", f"every rank arrived but {rank_list(stuck)} did not finish",
                         tuple(stuck))
    return Diagnosis("timeout", "every other rank reports it finished; this rank stalled in it", ())
