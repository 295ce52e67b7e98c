"""Moving bytes for the tcp backend: a non-blocking multi-socket pump and a threaded variant.

An algorithm is written as a `Plan`: per peer, an ordered list of sends and an ordered list of
receives. A send may be gated on the number of receives completed from some peer (a ring
forwards chunk c only once it has received and reduced chunk c); a receive may carry a callback
(validate a header, reduce a chunk into place) that runs as soon as its bytes are in.

`pump` drives a plan from one thread with non-blocking calls and `select`, so sending,
receiving and reducing interleave without thread switches; `pump_threaded` runs the sends of a
single-link-each-way plan (a ring) in a helper thread while the caller receives and reduces with
blocking calls, which wins for large arrays where both directions' copies must overlap.
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Callable, Optional


_DONTWAIT = socket.MSG_DONTWAIT
_TICK_S = 1.0


class LinkDown(Exception):
    """A data connection closed or failed mid-collective (the group turns it into an error)."""

    def __init__(self, peer: int, exc: Optional[BaseException] = None):
        super().__init__(peer, exc)
        self.peer = peer
        self.exc = exc


class Plan:
    """Ordered sends and receives per peer; see the module docstring."""

    __slots__ = ("sends", "recvs")

    def __init__(self):
        self.sends: dict[int, list] = {}
        self.recvs: dict[int, list] = {}

    def send(self, peer: int, view, gate: Optional[tuple[int, int]] = None) -> None:
        """Queue `view` for `peer`, optionally only after `gate=(peer, n)` receives completed."""
        if len(view) == 0:
            return
        gp, gc = gate if gate is not None else (-1, 0)
        self.sends.setdefault(peer, []).append((view, gp, gc))

    def recv(self, peer: int, view, callback: Optional[Callable[[], None]] = None) -> int:
        """Queue a receive of exactly len(view) bytes from `peer`; returns the count after it."""
        items = self.recvs.setdefault(peer, [])
        if len(view) == 0:
            if callback is not None:
                # An empty receive still has to happen in order (it may validate an empty
                # payload); keep it as a one-shot item with no bytes.
                items.append((view, callback))
            return len(items)
        items.append((view, callback))
        return len(items)

    def recv_count(self, peer: int) -> int:
        """How many receives from `peer` are queued so far."""
        return len(self.recvs.get(peer, ()))


def pump(plan: Plan, tx: list, rx: list) -> None:
    """Run `plan` to completion from this thread, sending on `tx[peer]`, receiving on `rx[peer]`.

    Raises:
        LinkDown: a peer closed its connection or the socket failed.
        Whatever a receive callback raises (mismatched headers).
    """
    sends = plan.sends
    recvs = plan.recvs
    s_idx = dict.fromkeys(sends, 0)
    s_off = dict.fromkeys(sends, 0)
    r_idx = dict.fromkeys(recvs, 0)
    r_off = dict.fromkeys(recvs, 0)
    active_s = [p for p in sends if sends[p]]
    active_r = [p for p in recvs if recvs[p]]
    while active_s or active_r:
        progressed = False
        for p in tuple(active_s):
            items = sends[p]
            i = s_idx[p]
            sock = tx[p]
            n_items = len(items)
            while i < n_items:
                view, gp, gc = items[i]
                if gp >= 0 and r_idx.get(gp, 0) < gc:
                    break
                off = s_off[p]
                try:
                    k = sock.send(view[off:], _DONTWAIT)
                except BlockingIOError:
                    break
                except OSError as exc:
                    raise LinkDown(p, exc) from exc
                progressed = True
                off += k
                if off < len(view):
                    s_off[p] = off
                    break
                s_off[p] = 0
                i += 1
            s_idx[p] = i
            if i == n_items:
                active_s.remove(p)
        for p in tuple(active_r):
            items = recvs[p]
            i = r_idx[p]
            sock = rx[p]
            n_items = len(items)
            while i < n_items:
                view, callback = items[i]
                off = r_off[p]
                n = len(view)
                if off < n:
                    try:
                        k = sock.recv_into(view[off:], n - off, _DONTWAIT)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        raise LinkDown(p, exc) from exc
                    if k == 0:
                        raise LinkDown(p, None)
                    progressed = True
                    off += k
                    if off < n:
                        r_off[p] = off
                        break
                r_off[p] = 0
                i += 1
                r_idx[p] = i
                if callback is not None:
                    callback()
                progressed = True
            r_idx[p] = i
            if i == n_items:
                active_r.remove(p)
        if not progressed:
            _wait_until_ready(plan, s_idx, r_idx, active_s, active_r, tx, rx)


def _wait_until_ready(plan: Plan, s_idx: dict, r_idx: dict, active_s: list, active_r: list,
                      tx: list, rx: list) -> None:
    """Block until a socket `pump` waits on can move bytes: every active receive, and each
    active send whose gate is open (a gated send waits for receives, not for its socket)."""
    rl = [rx[p] for p in active_r]
    wl = []
    sends = plan.sends
    for p in active_s:
        _view, gp, gc = sends[p][s_idx[p]]
        if gp < 0 or r_idx.get(gp, 0) >= gc:
            wl.append(tx[p])
    try:
        select.select(rl, wl, [], _TICK_S)
    except (OSError, ValueError) as exc:
        raise LinkDown((active_r or active_s)[0], exc) from exc


class _Job:
    __slots__ = ("items", "sock", "progress", "cond", "cancelled", "error", "done")

    def __init__(self, items, sock, progress, cond):
        self.items = items
        self.sock = sock
        self.progress = progress
        self.cond = cond
        self.cancelled = False
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


class SenderThread:
    """A persistent helper thread that performs the sends of a threaded ring."""

    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._job: Optional[_Job] = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, items, sock, progress, cond) -> _Job:
        """Send `items` on `sock`, each once `progress[0]` reaches its gate (`cond` signals)."""
        job = _Job(items, sock, progress, cond)
        with self._cond:
            self._job = job
            self._cond.notify()
        return job

    def stop(self) -> None:
        """End the thread (after the job it is running, if any)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                job, self._job = self._job, None
            try:
                for view, _gp, gc in job.items:
                    if gc:
                        with job.cond:
                            while job.progress[0] < gc and not job.cancelled:
                                job.cond.wait(_TICK_S)
                    if job.cancelled:
                        break
                    job.sock.sendall(view)
            except BaseException as exc:  # noqa: BLE001 - the receiving thread raises it
                job.error = exc
            finally:
                job.done.set()


def pump_threaded(plan: Plan, tx: list, rx: list, sender: SenderThread) -> None:
    """Run a plan with one send peer and one receive peer: sends in `sender`, receives here.

    Raises:
        LinkDown: as `pump`.
    """
    ((sp, s_items),) = plan.sends.items()
    ((rp, r_items),) = plan.recvs.items()
    for _view, gp, _gc in s_items:
        if gp not in (-1, rp):
            raise ValueError("pump_threaded gates sends on the one receiving peer only")
    progress = [0]
    cond = threading.Condition()
    job = sender.submit(s_items, tx[sp], progress, cond)
    sock = rx[rp]
    try:
        count = 0
        for view, callback in r_items:
            n = len(view)
            got = 0
            while got < n:
                try:
                    k = sock.recv_into(view[got:], n - got)
                except OSError as exc:
                    raise LinkDown(rp, exc) from exc
                if k == 0:
                    raise LinkDown(rp, None)
                got += k
            if callback is not None:
                callback()
            count += 1
            with cond:
                progress[0] = count
                cond.notify()
    except BaseException:
        with cond:
            job.cancelled = True
            cond.notify()
        raise
    # The last sends finish once the peer reads them; a dead peer surfaces as an error there.
    while not job.done.wait(_TICK_S):
        pass
    if job.error is not None:
        raise LinkDown(sp, job.error) from job.error
