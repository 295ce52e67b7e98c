"""The module-level collectives on tensors (all_reduce, broadcast, gather, ...), as in
`torch.distributed`: each resolves its group and root, then calls the group's method."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from shoal.collectives.api import Work
from shoal.collectives.types import ReduceOp, make_premul_sum
from shoal.collectives.world import group_peer, member_group
from shoal.core.timeouts import TimeoutLike


def _ret(work: Work, async_op: bool) -> Optional[Work]:
    # torch returns the Work only when asked for one; a synchronous call has waited already.
    return work if async_op else None


def all_reduce(tensor, op: ReduceOp = ReduceOp.SUM, group=None, async_op: bool = False,
               timeout: TimeoutLike = None) -> Optional[Work]:
    """Reduce `tensor` across the group in place on every rank."""
    pg = member_group(group)
    if pg is None:
        return None
    return _ret(pg.all_reduce(tensor, op, async_op=async_op, timeout=timeout), async_op)


def broadcast(tensor, src: Optional[int] = None, group=None, async_op: bool = False,
              timeout: TimeoutLike = None, group_src: Optional[int] = None) -> Optional[Work]:
    """Copy world rank `src`'s (or group rank `group_src`'s) `tensor` to every rank of the group."""
    pg = member_group(group)
    if pg is None:
        return None
    root = group_peer(pg, src, group_src, "src")
    return _ret(pg.broadcast(tensor, root, async_op=async_op, timeout=timeout), async_op)


def reduce(tensor, dst: Optional[int] = None, op: ReduceOp = ReduceOp.SUM, group=None,
           async_op: bool = False, timeout: TimeoutLike = None,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Reduce `tensor` into world rank `dst` (or group rank `group_dst`)."""
    pg = member_group(group)
    if pg is None:
        return None
    root = group_peer(pg, dst, group_dst, "dst")
    return _ret(pg.reduce(tensor, root, op, async_op=async_op, timeout=timeout), async_op)


def all_gather(tensor_list: list, tensor, group=None, async_op: bool = False,
               timeout: TimeoutLike = None) -> Optional[Work]:
    """Fill `tensor_list[j]` with group rank j's `tensor`."""
    pg = member_group(group)
    if pg is None:
        return None
    return _ret(pg.all_gather(tensor_list, tensor, async_op=async_op, timeout=timeout), async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False,
                           timeout: TimeoutLike = None) -> Optional[Work]:
    """Every rank's `input_tensor`, concatenated in rank order into `output_tensor`."""
    pg = member_group(group)
    if pg is None:
        return None
    work = pg.all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op,
                                     timeout=timeout)
    return _ret(work, async_op)


def gather(tensor, gather_list: Optional[list] = None, dst: Optional[int] = None, group=None,
           async_op: bool = False, timeout: TimeoutLike = None,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Collect every rank's `tensor` into `gather_list` on world rank `dst` (or `group_dst`)."""
    pg = member_group(group)
    if pg is None:
        return None
    root = group_peer(pg, dst, group_dst, "dst")
    return _ret(pg.gather(tensor, gather_list, root, async_op=async_op, timeout=timeout), async_op)


def scatter(tensor, scatter_list: Optional[list] = None, src: Optional[int] = None, group=None,
            async_op: bool = False, timeout: TimeoutLike = None,
            group_src: Optional[int] = None) -> Optional[Work]:
    """World rank `src` (or group rank `group_src`) sends `scatter_list[j]` to group rank j."""
    pg = member_group(group)
    if pg is None:
        return None
    root = group_peer(pg, src, group_src, "src")
    return _ret(pg.scatter(tensor, scatter_list, root, async_op=async_op, timeout=timeout), async_op)


def reduce_scatter(output, input_list: list, op: ReduceOp = ReduceOp.SUM, group=None,
                   async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Reduce `input_list[j]` across ranks into group rank j's `output`."""
    pg = member_group(group)
    if pg is None:
        return None
    return _ret(pg.reduce_scatter(output, input_list, op, async_op=async_op, timeout=timeout), async_op)


def all_to_all(output_tensor_list: list, input_tensor_list: list, group=None,
               async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Send `input_tensor_list[j]` to group rank j; receive into `output_tensor_list[i]`."""
    pg = member_group(group)
    if pg is None:
        return None
    return _ret(pg.all_to_all(output_tensor_list, input_tensor_list, async_op=async_op, timeout=timeout), async_op)


def barrier(group=None, async_op: bool = False, device_ids: Any = None,
            timeout: TimeoutLike = None) -> Optional[Work]:
    """Return once every rank of the group has called barrier (torch's `device_ids` is for
    NCCL's device choice and not used)."""
    pg = member_group(group)
    if pg is None:
        return None
    return _ret(pg.barrier(async_op=async_op, timeout=timeout), async_op)


def monitored_barrier(group=None, timeout: TimeoutLike = None, wait_all_ranks: bool = False) -> None:
    """A barrier whose rank 0 names the ranks that did not arrive within `timeout`."""
    pg = member_group(group)
    if pg is None:
        return None
    pg.monitored_barrier(timeout=timeout, wait_all_ranks=wait_all_ranks)


def reduce_scatter_tensor(output, input,  # noqa: A002 - torch's parameter name
                          op: ReduceOp = ReduceOp.SUM, group=None,
                          async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """`output` := the reduction of this rank's block of every rank's `input` (W blocks)."""
    pg = member_group(group)
    if pg is None:
        return None
    work = pg.reduce_scatter_tensor(output, input, op, async_op=async_op, timeout=timeout)
    return _ret(work, async_op)


def reduce_scatter_single(output, input,  # noqa: A002 - torch's parameter name
                          op: ReduceOp = ReduceOp.SUM, group=None,
                          async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """torch's newer name of reduce_scatter_tensor."""
    return reduce_scatter_tensor(output, input, op, group, async_op, timeout)


def all_gather_single(output_tensor, input_tensor, group=None, async_op: bool = False,
                      timeout: TimeoutLike = None) -> Optional[Work]:
    """torch's newer name of all_gather_into_tensor."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, timeout)


def _all_gather_base(output_tensor, input_tensor, group=None, async_op: bool = False):
    """torch's older name of all_gather_into_tensor."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def _reduce_scatter_base(output, input,  # noqa: A002 - torch's parameter name
                         op: ReduceOp = ReduceOp.SUM, group=None,
                         async_op: bool = False):
    """torch's older name of reduce_scatter_tensor."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all_single(output, input,  # noqa: A002 - torch's parameter name
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None, group=None,
                      async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Rows of `input` in blocks to each rank; theirs into `output` (equal or given splits)."""
    pg = member_group(group)
    if pg is None:
        return None
    return _ret(pg.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                     async_op=async_op, timeout=timeout), async_op)


def all_reduce_coalesced(tensors: Sequence, op: ReduceOp = ReduceOp.SUM, group=None,
                         async_op: bool = False, timeout: TimeoutLike = None) -> Optional[Work]:
    """Reduce each tensor in place, with one all_reduce per dtype."""
    pg = member_group(group)
    if pg is None:
        return None
    return _ret(pg.all_reduce_coalesced(tensors, op, timeout=timeout), async_op)


def all_gather_coalesced(output_tensor_lists: Sequence[Sequence], input_tensor_list: Sequence,
                         group=None, async_op: bool = False,
                         timeout: TimeoutLike = None) -> Optional[Work]:
    """`output_tensor_lists[r][i]` := group rank r's `input_tensor_list[i]`."""
    pg = member_group(group)
    if pg is None:
        return None
    work = pg.all_gather_coalesced(output_tensor_lists, input_tensor_list, timeout=timeout)
    return _ret(work, async_op)


def _make_nccl_premul_sum(factor: float):
    """torch's name for make_premul_sum (shoal's PREMUL_SUM runs on every backend)."""
    return make_premul_sum(factor)
