"""Rendezvous test helpers shared by the backend contract and the etcd integration tests."""

from __future__ import annotations

import threading


def join_all(handlers, wait_s: float = 30.0) -> list:
    """Call next_rendezvous() on every handler at once; their RendezvousInfos, in order."""
    out, errors = {}, []

    def join(i, h):
        try:
            out[i] = h.next_rendezvous()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i, h)) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait_s + 5)
    assert not errors, errors
    assert len(out) == len(handlers), "a join did not return"
    return [out[i] for i in range(len(handlers))]
