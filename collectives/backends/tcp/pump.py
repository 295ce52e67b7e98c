"""Moving bytes for the tcp backend: a non-blocking multi-socket pump and a threaded variant.

An algorithm is written as a `Plan`: per peer, an ordered list of sends and an ordered list of
receives. A send may be gated on the number of receives completed from some peer (a ring
forwards chunk c only once it has received and reduced chunk c); a receive may carry a callback
(validate a header, reduce a chunk into place) that runs as soon as its bytes are in.

Every send is one frame (`framing`): its tag is computed when the send starts, after its gate
opened, so forwarded data is tagged as it was just reduced. Every receive but the fixed part
of a header is one frame too, and its tag is checked before its callback runs: a chunk is
checked before it is reduced into place.

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

from shoal.collectives.backends.tcp import framing
from shoal.collectives.backends.tcp.wire import send_all


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

    def send(self, peer: int, view, gate: Optional[tuple[int, int]] = None,
             header: bool = False) -> None:
        """Queue `view` for `peer` as one frame (a `header` is tagged in the clear in any
        mode), optionally only after `gate=(peer, n)` receives completed."""
        if len(view) == 0:
            return
        gp, gc = gate if gate is not None else (-1, 0)
        self.sends.setdefault(peer, []).append((view, gp, gc, header))

    def recv(self, peer: int, view, callback: Optional[Callable[[], None]] = None,
             cover=True) -> int:
        """Queue a receive of exactly len(view) bytes from `peer`; returns the count after it.

        `cover`: True for a payload frame (its tag follows; sealed in encrypt mode); None for
        bytes that only open a frame (a header's fixed part, no tag yet); or the whole header
        that these bytes end, whose tag follows them.
        """
        items = self.recvs.setdefault(peer, [])
        if len(view) == 0:
            if callback is not None:
                # An empty receive still has to happen in order (it may validate an empty
                # payload); keep it as a one-shot item with no bytes (and no frame).
                items.append((view, callback, None))
            return len(items)
        items.append((view, callback, cover))
        return len(items)

    def recv_count(self, peer: int) -> int:
        """How many receives from `peer` are queued so far."""
        return len(self.recvs.get(peer, ()))


def pump(plan: Plan, tx: list, rx: list) -> None:
    """Run `plan` to completion from this thread, sending on `tx[peer]`, receiving on `rx[peer]`
    (`framing.Outbound`/`Inbound`).

    Raises:
        LinkDown: a peer closed its connection or the socket failed.
        framing.Tampered: a frame failed its integrity check.
        Whatever a receive callback raises (mismatched headers).
    """
    sends = plan.sends
    recvs = plan.recvs
    s_idx = dict.fromkeys(sends, 0)
    r_idx = dict.fromkeys(recvs, 0)
    # The frame each peer is in the middle of: its buffers and the bytes done so far.
    s_cur: dict = {}
    r_cur: dict = {}
    active_s = [p for p in sends if sends[p]]
    active_r = [p for p in recvs if recvs[p]]
    while active_s or active_r:
        progressed = False
        for p in tuple(active_s):
            moved, done = _send_some(sends[p], s_idx, s_cur, r_idx, p, tx[p])
            progressed |= moved
            if done:
                active_s.remove(p)
        for p in tuple(active_r):
            moved, done = _recv_some(recvs[p], r_idx, r_cur, p, rx[p])
            progressed |= moved
            if done:
                active_r.remove(p)
        if not progressed:
            _wait_until_ready(plan, s_idx, r_idx, active_s, active_r, tx, rx)


def _send_some(items: list, s_idx: dict, s_cur: dict, r_idx: dict, p: int,
               out: "framing.Outbound") -> tuple[bool, bool]:
    """Send what `p`'s socket takes without blocking: (progressed, every item sent)."""
    i = s_idx[p]
    n_items = len(items)
    progressed = False
    while i < n_items:
        cur = s_cur.get(p)
        if cur is None:
            view, gp, gc, header = items[i]
            if gp >= 0 and r_idx.get(gp, 0) < gc:
                break
            parts = out.header(view) if header else out.frame(view)
            cur = s_cur[p] = [parts, 0, sum(len(x) for x in parts)]
        parts, off, total = cur
        try:
            k = out.sock.sendmsg(framing.remaining(parts, off), (), _DONTWAIT)
        except BlockingIOError:
            break
        except OSError as exc:
            raise LinkDown(p, exc) from exc
        progressed = True
        if off + k < total:
            cur[1] = off + k
            break
        s_cur[p] = None
        i += 1
    s_idx[p] = i
    return progressed, i == n_items


def _recv_some(items: list, r_idx: dict, r_cur: dict, p: int,
               inb: "framing.Inbound") -> tuple[bool, bool]:
    """Receive what `p`'s socket has, checking and finishing each whole frame:
    (progressed, every item received)."""
    i = r_idx[p]
    n_items = len(items)
    progressed = False
    while i < n_items:
        view, callback, cover = items[i]
        cur = r_cur.get(p)
        if cur is None:
            if cover is None:
                parts = [view]
            elif cover is True:
                parts = inb.landing(view)
            else:
                parts = [view, inb.trailer]
            cur = r_cur[p] = [parts, 0, sum(len(x) for x in parts)]
        parts, off, total = cur
        if off < total:
            rest = framing.remaining(parts, off)
            try:
                if len(rest) == 1:
                    k = inb.sock.recv_into(rest[0], len(rest[0]), _DONTWAIT)
                else:
                    k = inb.sock.recvmsg_into(rest, 0, _DONTWAIT)[0]
            except BlockingIOError:
                break
            except OSError as exc:
                raise LinkDown(p, exc) from exc
            if k == 0:
                raise LinkDown(p, None)
            progressed = True
            if off + k < total:
                cur[1] = off + k
                break
        r_cur[p] = None
        if cover is True:
            inb.land(p, view)
        elif cover is not None:
            inb.verify(p, cover, inb.trailer, "a collective header")
        i += 1
        r_idx[p] = i
        if callback is not None:
            callback()
        progressed = True
    r_idx[p] = i
    return progressed, i == n_items


def _wait_until_ready(plan: Plan, s_idx: dict, r_idx: dict, active_s: list, active_r: list,
                      tx: list, rx: list) -> None:
    """Block until a socket `pump` waits on can move bytes: every active receive, and each
    active send whose gate is open (a gated send waits for receives, not for its socket)."""
    rl = [rx[p] for p in active_r]
    wl = []
    sends = plan.sends
    for p in active_s:
        _view, gp, gc, _header = sends[p][s_idx[p]]
        if gp < 0 or r_idx.get(gp, 0) >= gc:
            wl.append(tx[p])
    try:
        select.select(rl, wl, [], _TICK_S)
    except (OSError, ValueError) as exc:
        raise LinkDown((active_r or active_s)[0], exc) from exc


class _Job:
    __slots__ = ("items", "out", "progress", "cond", "cancelled", "error", "done")

    def __init__(self, items, out, progress, cond):
        self.items = items
        self.out = out
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

    def submit(self, items, out, progress, cond) -> _Job:
        """Send `items` on `out` (a `framing.Outbound`), each once `progress[0]` reaches its
        gate (`cond` signals)."""
        job = _Job(items, out, progress, cond)
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
                for view, _gp, gc, header in job.items:
                    if gc:
                        with job.cond:
                            while job.progress[0] < gc and not job.cancelled:
                                job.cond.wait(_TICK_S)
                    if job.cancelled:
                        break
                    # Tagged (or sealed) here, as it goes out: after the gate opened.
                    out = job.out
                    send_all(out.sock, out.header(view) if header else out.frame(view))
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
    for _view, gp, _gc, _header in s_items:
        if gp not in (-1, rp):
            raise ValueError("pump_threaded gates sends on the one receiving peer only")
    progress = [0]
    cond = threading.Condition()
    job = sender.submit(s_items, tx[sp], progress, cond)
    inb = rx[rp]
    try:
        count = 0
        for view, callback, cover in r_items:
            if len(view):
                try:
                    received = inb.receive(rp, view, cover)
                except OSError as exc:
                    raise LinkDown(rp, exc) from exc
                if not received:
                    raise LinkDown(rp, None)
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
