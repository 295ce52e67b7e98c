"""Ranks as threads of one process: form a group per rank and run a function on every rank."""

from __future__ import annotations

import threading
from typing import Callable


def form_groups(world: int, make_pg: Callable[[int], object]) -> list:
    """make_pg(rank) on `world` threads at once (groups form together); fails on any error."""
    pgs: list = [None] * world
    errors: list = []

    def join(r):
        try:
            pgs[r] = make_pg(r)
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(pg is not None for pg in pgs), f"some ranks never formed their group: {pgs}"
    return pgs


def run_all(pgs, fn, timeout: float = 30.0) -> list:
    """fn(pg, rank) on every rank in its own thread; returns values or the exceptions raised."""
    out: list = [None] * len(pgs)

    def body(r):
        try:
            out[r] = fn(pgs[r], r)
        except BaseException as exc:  # noqa: BLE001  (handed to the test, which reports it)
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(pgs))]
    for t in threads:
        t.start()
    for r, t in enumerate(threads):
        t.join(timeout)
        assert not t.is_alive(), f"rank {r} hung"
    return out
