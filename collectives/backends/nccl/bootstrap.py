"""Forming an NCCL communicator through the job's store, with every step bounded.

1. Each rank counts itself into the group's generation (as the tcp backend does), so a group
   re-created under the same name on the same store uses fresh keys.
2. Each rank announces its host and device, and waits for every other rank's announcement: a
   rank that never arrives is named here, by the store, instead of NCCL blocking without end.
   Two ranks on one GPU of one host are refused here too (NCCL would fail less clearly).
3. Rank 0 makes the ncclUniqueId and publishes it; the others read it (the store authenticates
   its clients, so only the job's ranks learn the id).
4. ncclCommInitRank runs in a helper thread: it blocks until every rank joined and cannot be
   interrupted, so the caller waits for it with the remaining time and, past that, raises
   instead of hanging (the helper thread is abandoned).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

from shoal.collectives.backends.progress import rank_list
from shoal.collectives.store.api import Store
from shoal.collectives.types import CollectiveError, CollectiveTimeout, StoreError, StoreTimeout

logger = logging.getLogger(__name__)

__all__ = ["join_generation", "announce", "await_peers", "exchange_unique_id", "init_communicator"]


def join_generation(store: Store, name: str, rank: int, size: int) -> str:
    """Count this rank into the next incarnation of group `name`; returns its key prefix."""
    base = f"shoal/nccl/{name}"
    try:
        joined = store.add(f"{base}/joins", 1)
    except StoreError as exc:
        raise CollectiveError(
            f"Rank {rank} could not join nccl group '{name}' through the store: {exc}"
        ) from exc
    return f"{base}/{(joined - 1) // size}"


def announce(store: Store, prefix: str, rank: int, device: int, host: str = "") -> None:
    """Publish that `rank` arrived, on which host and device."""
    doc = {"host": host or socket.gethostname(), "device": int(device)}
    store.set(f"{prefix}/arrived/{rank}", json.dumps(doc))


def await_peers(store: Store, prefix: str, rank: int, size: int, name: str,
                deadline: float) -> dict[int, dict]:
    """Every rank's announcement, waiting until `deadline` (time.monotonic()).

    Raises:
        CollectiveTimeout: naming the ranks that never arrived.
        CollectiveError: two ranks share a GPU, or the store failed.
    """
    keys = [f"{prefix}/arrived/{q}" for q in range(size)]
    waited = max(0.0, deadline - time.monotonic())
    try:
        store.wait(keys, timeout=waited)
        raw = store.multi_get(keys, timeout=max(0.1, deadline - time.monotonic()))
    except StoreTimeout as exc:
        try:
            missing = [q for q, k in enumerate(keys) if not store.check([k])]
        except StoreError:
            missing = []
        who = rank_list(missing) + " never arrived" if missing else "some ranks never arrived"
        raise CollectiveTimeout(
            f"Rank {rank} of nccl group '{name}' waited {waited:.3g}s for the other ranks to "
            f"join: {who} (did every rank call init_process_group/new_group?)."
        ) from exc
    except StoreError as exc:
        raise CollectiveError(
            f"Rank {rank} of nccl group '{name}' could not read the other ranks' arrival from "
            f"the store: {exc}"
        ) from exc
    peers = {q: json.loads(v) for q, v in enumerate(raw)}
    seen: dict[tuple, int] = {}
    for q in range(size):
        where = (peers[q]["host"], peers[q]["device"])
        if where in seen:
            raise CollectiveError(
                f"Ranks {seen[where]} and {q} of nccl group '{name}' both use CUDA device "
                f"{where[1]} on host {where[0]!r}; NCCL needs one device per rank (set "
                "LOCAL_RANK, or pass device= to init_process_group's backend)."
            )
        seen[where] = q
    return peers


def exchange_unique_id(store: Store, prefix: str, rank: int, name: str, make_id,
                       deadline: float) -> bytes:
    """Rank 0 publishes `make_id()`; every rank returns it."""
    key = f"{prefix}/unique_id"
    if rank == 0:
        uid = make_id()
        store.set(key, uid)
        return uid
    try:
        return store.get(key, timeout=max(0.1, deadline - time.monotonic()))
    except StoreTimeout as exc:
        raise CollectiveTimeout(
            f"Rank {rank} of nccl group '{name}' never received the NCCL unique id from rank 0 "
            "through the store."
        ) from exc


def init_communicator(create, rank: int, size: int, name: str, deadline: float) -> Any:
    """Run the blocking `create()` (ncclCommInitRank) with a deadline; return its result.

    Raises:
        CollectiveTimeout: it did not return in time (the helper thread stays blocked in NCCL;
            nothing can interrupt ncclCommInitRank on a blocking communicator).
        CollectiveError: it failed.
    """
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["comm"] = create()
        except BaseException as exc:  # noqa: BLE001 - the caller raises it, in its thread
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=run, name=f"shoal-nccl-{name}-init", daemon=True)
    started = time.monotonic()
    thread.start()
    if not done.wait(max(0.0, deadline - started)):
        raise CollectiveTimeout(
            f"Rank {rank} of nccl group '{name}' waited {deadline - started:.3g}s in "
            f"ncclCommInitRank for the other {size - 1} rank(s), which announced themselves in "
            "the store but never connected to NCCL (a rank died or hangs between the two); "
            "the blocked NCCL call cannot be cancelled, so end this process."
        )
    if "error" in box:
        exc = box["error"]
        raise CollectiveError(
            f"Rank {rank} of nccl group '{name}' could not create its NCCL communicator: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return box["comm"]
