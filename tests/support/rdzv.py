"""Rendezvous test helpers shared by the backend contract, the state machine, the join-outage
and the etcd integration tests."""

from __future__ import annotations

import threading
import time
from typing import Optional

from shoal.elastic.api import RendezvousBackend, RendezvousError


class FlakyBackend(RendezvousBackend):
    """Passes through to `inner`, but raises like an unreachable server ("<label> backend is
    down") while `down` is set, after `call_delay_s` (a real connection attempt takes time).
    `watch_cap_s` bounds each watch, so that a watcher notices an outage that soon."""

    def __init__(self, inner: RendezvousBackend, down: threading.Event, label: str = "flaky",
                 call_delay_s: float = 0.0, watch_cap_s: Optional[float] = None):
        self.inner, self.down = inner, down
        self.label, self.call_delay_s, self.watch_cap_s = label, call_delay_s, watch_cap_s

    @property
    def name(self):
        return self.label

    def describe(self) -> str:
        return f"the {self.label} backend at test:1"

    def _check(self):
        if self.down.is_set():
            if self.call_delay_s:
                time.sleep(self.call_delay_s)
            raise RendezvousError(f"{self.label} backend is down")

    def get_state(self):
        self._check()
        return self.inner.get_state()

    def set_state(self, state, token=None):
        self._check()
        return self.inner.set_state(state, token)

    def watch(self, token, timeout):
        self._check()
        if self.watch_cap_s is not None:
            timeout = min(float(timeout), self.watch_cap_s)
        return self.inner.watch(token, timeout)


def join_all(handlers, wait_s: float = 30.0) -> list:
    """Call next_rendezvous() on every handler at once; their RendezvousInfos, in order."""
    out, errors = {}, []

    def join(i, h):
        try:
            out[i] = h.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001  (handed to the test, which reports it)
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i, h)) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait_s + 5)
    assert not errors, errors
    assert len(out) == len(handlers), "a join did not return"
    return [out[i] for i in range(len(handlers))]
