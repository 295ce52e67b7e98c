"""Point-to-point messages between ranks: send, recv, their non-blocking forms and
batch_isend_irecv, as in `torch.distributed`; peers are world ranks (or group ranks via
`group_dst` / `group_src`)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from shoal.collectives.api import Work
from shoal.collectives.world import get_process_group_ranks, group_peer, member_group
from shoal.core.timeouts import TimeoutLike


def isend(tensor, dst: Optional[int] = None, group=None, tag: int = 0,
          timeout: TimeoutLike = None, group_dst: Optional[int] = None) -> Optional[Work]:
    """Send to world rank `dst` (or group rank `group_dst`) without waiting; returns the Work."""
    return _start_send(tensor, dst, group, tag, timeout, group_dst, async_op=True)


def _start_send(tensor, dst, group, tag, timeout, group_dst, async_op: bool) -> Optional[Work]:
    # isend (async_op) and send: a synchronous send is an operation of its own, not an isend
    # and a wait, so a group with nothing queued runs it in the caller's thread.
    pg = member_group(group)
    if pg is None:
        return None
    _need_peer(dst, group_dst, "dst")
    return pg.send(tensor, group_peer(pg, dst, group_dst, "dst"), tag, async_op=async_op,
                   timeout=timeout)


def _need_peer(world_rank: Optional[int], group_rank: Optional[int], what: str) -> None:
    # A send has no "any rank"; a receive may leave both out (see irecv).
    if world_rank is None and group_rank is None:
        raise ValueError(f"Pass {what} (a world rank) or group_{what} (a rank of the group).")


def irecv(tensor, src: Optional[int] = None, group=None, tag: int = 0,
          timeout: TimeoutLike = None, group_src: Optional[int] = None) -> Optional[Work]:
    """Receive from world rank `src` (or group rank `group_src`; neither: any) without
    waiting; returns the Work."""
    pg = member_group(group)
    if pg is None:
        return None
    return _start_recv(pg, tensor, src, tag, timeout, group_src, async_op=True)


def _start_recv(pg, tensor, src, tag, timeout, group_src, async_op: bool) -> Work:
    # irecv (async_op) and recv: a synchronous receive is an operation of its own, so a group
    # with nothing queued receives in the caller's thread, which reads the source's connection
    # itself (one wake-up when the message comes, where the worker thread's receive cost two:
    # its own and then the caller's).
    local = None if src is None and group_src is None else group_peer(pg, src, group_src, "src")
    return pg.recv(tensor, local, tag, async_op=async_op, timeout=timeout)


def send(tensor, dst: Optional[int] = None, group=None, tag: int = 0,
         timeout: TimeoutLike = None, group_dst: Optional[int] = None) -> None:
    """Send `tensor` to world rank `dst` (or group rank `group_dst`)."""
    work = _start_send(tensor, dst, group, tag, timeout, group_dst, async_op=False)
    if work is not None:
        work.wait()


def recv(tensor, src: Optional[int] = None, group=None, tag: int = 0,
         timeout: TimeoutLike = None, group_src: Optional[int] = None) -> int:
    """Receive into `tensor` from world rank `src` (or group rank `group_src`; neither: any);
    returns the sender's world rank (-1 if not a member)."""
    pg = member_group(group)
    if pg is None:
        return -1
    work = _start_recv(pg, tensor, src, tag, timeout, group_src, async_op=False)
    work.wait()
    return get_process_group_ranks(pg)[work.source_rank]


class P2POp:
    """One point-to-point operation for batch_isend_irecv: `P2POp(isend, tensor, peer)`."""

    def __init__(self, op: Callable, tensor, peer: Optional[int] = None, group=None, tag: int = 0,
                 group_peer: Optional[int] = None):
        if op not in (isend, irecv):
            raise ValueError(
                "Invalid op: P2POp expects collectives.isend or collectives.irecv, got "
                f"{getattr(op, '__name__', op)!r}."
            )
        if (peer is None) == (group_peer is None):
            raise ValueError("P2POp needs exactly one of peer (a world rank) and group_peer.")
        self.op = op
        self.tensor = tensor
        self.group = group
        self.tag = tag
        if peer is None:
            pg = member_group(group)
            peer = get_process_group_ranks(pg)[group_peer] if pg is not None else -1
        self.peer = peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list:
    """Start every P2POp and return their Works (wait on each), as torch's batch_isend_irecv."""
    ops = list(p2p_op_list)
    if not ops or not all(isinstance(p, P2POp) for p in ops):
        raise ValueError("batch_isend_irecv needs a non-empty list of P2POp.")
    group = ops[0].group
    # The same group object for every op (the usual batch) needs no per-op lookup.
    if (any(p.group is not group for p in ops)
            and len({id(member_group(p.group)) for p in ops}) != 1):
        raise ValueError("All P2POps of one batch_isend_irecv must use the same group.")
    pg = member_group(group)
    batch = getattr(pg, "batch_p2p", None)
    if batch is not None:
        # One operation for the whole batch (the tcp backend): one hand-off to its worker
        # instead of one per op.
        return batch([(p.op is isend, p.tensor, group_peer(pg, p.peer, None, "peer"), p.tag)
                      for p in ops])
    works = []
    for p in ops:
        work = p.op(p.tensor, p.peer, p.group, p.tag)
        if work is not None:
            works.append(work)
    return works
