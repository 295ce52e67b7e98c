"""Collectives on picklable Python objects (all_gather_object, broadcast_object_list,
gather_object, scatter_object_list, send_object_list / recv_object_list), as in
`torch.distributed`. Objects travel pickled in uint8 arrays (`collectives.arrays`); unpickling
trusts the peers, which the group authenticated with the job's secret."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from shoal.collectives import arrays
from shoal.collectives.p2p import recv, send
from shoal.collectives.world import group_peer, member_group
from shoal.core.timeouts import TimeoutLike


def all_gather_object(object_list: list, obj: Any, group=None, timeout: TimeoutLike = None) -> None:
    """Fill `object_list` (one slot per rank) with every rank's picklable `obj`."""
    pg = member_group(group)
    if pg is None:
        return None
    if len(object_list) != pg.size():
        raise ValueError(
            f"all_gather_object needs an object_list of {pg.size()} slots, got {len(object_list)}."
        )
    object_list[:] = pg.all_gather_object(obj, timeout=timeout)


def broadcast_object_list(object_list: list, src: Optional[int] = None, group=None,
                          timeout: TimeoutLike = None, device: Any = None,
                          group_src: Optional[int] = None) -> None:
    """Replace `object_list`'s items with world rank `src`'s (or group rank `group_src`'s);
    torch's `device` is not needed on the host and not used."""
    pg = member_group(group)
    if pg is None:
        return None
    pg.broadcast_object_list(object_list, group_peer(pg, src, group_src, "src"), timeout=timeout)


def gather_object(obj: Any, object_gather_list: Optional[list] = None, dst: Optional[int] = None,
                  group=None, timeout: TimeoutLike = None,
                  group_dst: Optional[int] = None) -> None:
    """Every rank's picklable `obj` into `object_gather_list` on world rank `dst` (or group
    rank `group_dst`)."""
    pg = member_group(group)
    if pg is None:
        return None
    pg.gather_object(obj, object_gather_list, group_peer(pg, dst, group_dst, "dst"), timeout=timeout)


def scatter_object_list(scatter_object_output_list: list,
                        scatter_object_input_list: Optional[list] = None,
                        src: Optional[int] = None, group=None, timeout: TimeoutLike = None,
                        group_src: Optional[int] = None) -> None:
    """World rank `src`'s `scatter_object_input_list[j]` into group rank j's output list [0]."""
    pg = member_group(group)
    if pg is None:
        return None
    pg.scatter_object_list(scatter_object_output_list, scatter_object_input_list,
                           group_peer(pg, src, group_src, "src"), timeout=timeout)


def send_object_list(object_list: list, dst: Optional[int] = None, group=None,
                     device: Any = None, timeout: TimeoutLike = None,
                     group_dst: Optional[int] = None, use_batch: bool = False) -> None:
    """Send every picklable object of `object_list` to world rank `dst` (torch's
    send_object_list; the receiver passes a list of the same length to recv_object_list)."""
    blobs = [arrays.pickle_to_array(o) for o in object_list]
    data = np.concatenate(blobs) if blobs else np.empty(0, np.uint8)
    for part in (np.array([b.size for b in blobs], dtype=np.int64), data):
        send(part, dst, group, timeout=timeout, group_dst=group_dst)


def recv_object_list(object_list: list, src: Optional[int] = None, group=None,
                     device: Any = None, timeout: TimeoutLike = None,
                     group_src: Optional[int] = None, use_batch: bool = False) -> int:
    """Fill `object_list` with the objects world rank `src` (None: any) sent with
    send_object_list; returns the sender's world rank (-1 if not a member of `group`)."""
    sizes = np.empty(len(object_list), dtype=np.int64)
    sender = recv(sizes, src, group, timeout=timeout, group_src=group_src)
    if sender < 0:
        return sender
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    recv(data, sender, group, timeout=timeout)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(len(object_list)):
        object_list[i] = arrays.array_to_object(data[offsets[i]:offsets[i + 1]])
    return sender
