"""One fully_shard module's parameters: their shards, the all_gather that unshards them and the
reduce_scatter that shards their gradients.

Each parameter of n elements is flattened and cut into W chunks of c = ceil(n / W) elements (the
last padded with zeros); rank r keeps chunk r as a flat `ShardedParameter`, which is what the
module holds and what the optimizer steps between iterations. A group's chunks lie end to end in
one send buffer of S = sum(c) elements, so one all_gather of W x S elements unshards the whole
module (rank-major: rank r's chunks, then rank r+1's), and one reduce_scatter of W x S gradient
elements, packed in the same layout, leaves each rank the sum of its own chunks.

The unsharded parameters are views of one buffer per group, allocated once as a private
anonymous memory map: the ops of forward keep views of the weights they used for their
backward, so the buffer cannot be freed while a graph holds it, but its pages can be.
Resharding gives them back to the kernel and the next unshard writes the gathered values into
the same memory, exactly where those views look (torch's storage resize-to-zero trick on host
memory). They go back with MADV_FREE, as jemalloc purges: the kernel reclaims the pages when it
needs memory, and until then a gather rewrites them without faulting each page in again (faults
cost 0.7 ms a MiB here, about half of fully_shard's own time in a GPT step); where MADV_FREE is
missing, MADV_DONTNEED drops them at once. Either way the views stay valid; what they read
between a reshard and the next unshard is undefined (stale values or zeros), and nothing reads
it then.
"""

from __future__ import annotations

import mmap
from typing import Any, Callable, Optional, Sequence

import numpy as np

from shoal.collectives.fsdp.api import FSDPError, MixedPrecisionPolicy, ShardedParameter
from shoal.collectives.types import ReduceOp
from shoal.core.nn.module import Module
from shoal.core.nn.parameter import Parameter
from shoal.core.tensor import Tensor

__all__ = ["FSDPParam", "ParamGroup"]


class FSDPParam:
    """One parameter: where the module holds it, its shard, and its unsharded view."""

    def __init__(self, owners: list[tuple[Module, str]], param: Parameter, world: int,
                 rank: int, slot: int, offset: int) -> None:
        self.owners = owners  # a tied weight (GPT's embedding and head) has two
        if type(param.array) is not np.ndarray:
            raise FSDPError(
                f"fully_shard: parameter {owners[0][1]!r} lives on {param.device}; shoal's "
                "fully_shard shards host (numpy) parameters only, so far: its gathered memory "
                "is released page by page, which device memory cannot be. Move the module to "
                "the CPU, or use DistributedDataParallel on the device.")
        self.shape = tuple(param.shape)
        self.numel = int(param.numel())
        self.chunk = -(-self.numel // world)
        self.slot, self.offset = slot, offset  # in the send buffer; in the unsharded buffer
        self.dtype = param.array.dtype
        self.device = param.device
        self.flat_view: Optional[np.ndarray] = None  # the shard's place in the group's buffer
        flat = param.array.reshape(-1)
        start, stop = min(rank * self.chunk, self.numel), min((rank + 1) * self.chunk, self.numel)
        local = np.zeros(self.chunk, dtype=self.dtype)
        local[:stop - start] = flat[start:stop]
        shard = ShardedParameter(local, requires_grad=param.requires_grad)
        shard.global_shape, shard.shard_offset, shard.shard_numel = self.shape, start, stop - start
        self.shard = shard
        self.full: Optional[Parameter] = None


class ParamGroup:
    """The sharded parameters of one module and their collectives over `group`."""

    def __init__(self, entries: list[tuple[list, Parameter]], group: Any,
                 replicate: Any, mp: MixedPrecisionPolicy, offload: bool,
                 on_grads_ready: Callable[["ParamGroup"], None]) -> None:
        self.pg, self.replicate = group, replicate
        self.world, self.rank = group.size(), group.rank()
        # CPUOffloadPolicy asked for: shards are host arrays in any case (FSDPParam's check).
        self.mp, self.offload = mp, offload
        self.params: list[FSDPParam] = []
        slot = offset = 0
        for owners, param in entries:
            fp = FSDPParam(owners, param, self.world, self.rank, slot, offset)
            self.params.append(fp)
            slot, offset = slot + fp.chunk, offset + fp.numel
            fp.shard.group = group
        self.use_shards()
        self.send_numel, self.full_numel = slot, offset
        dtypes = {fp.dtype for fp in self.params}
        if len(dtypes) > 1:
            raise FSDPError(f"fully_shard: one module's parameters must share a dtype to be "
                            f"gathered together, got {sorted(map(str, dtypes))}.")
        base = next(iter(dtypes), np.dtype(np.float32))
        self._flat_shards = self._adopt_shards(base)
        self.param_dtype = mp.np_dtype("param_dtype", base)
        self.reduce_dtype = mp.np_dtype("reduce_dtype", self.param_dtype)
        self._on_grads_ready = on_grads_ready
        self._map: Optional[mmap.mmap] = None
        self._unsharded_buf: Optional[np.ndarray] = None
        self.unsharded = False
        self._gather: Optional[tuple[Any, np.ndarray, np.ndarray]] = None
        self._reduce: Optional[tuple[Any, np.ndarray, np.ndarray]] = None
        self.ready = 0
        self._no_local_grad: set[int] = set()
        self.grads_done = False  # this backward has taken the group's gradients already
        self.expected = sum(fp.shard.requires_grad for fp in self.params)

    def _adopt_shards(self, dtype: np.dtype) -> np.ndarray:
        """Move the shards end to end into one buffer laid out as the all_gather sends it, so
        that (without a param_dtype cast) the gather sends the shards' own memory, uncopied;
        the optimizer steps them in place there."""
        flat = np.empty(sum(fp.chunk for fp in self.params), dtype=dtype)
        for fp in self.params:
            view = flat[fp.slot:fp.slot + fp.chunk]
            view[...] = fp.shard.array
            fp.shard.array = fp.flat_view = view
        return flat

    def send_buffer(self) -> np.ndarray:
        """The shards as one flat array in param_dtype: the shards' own buffer where it can be."""
        if self.param_dtype != self._flat_shards.dtype:
            send = np.empty(self.send_numel, dtype=self.param_dtype)
            for fp in self.params:
                send[fp.slot:fp.slot + fp.chunk] = fp.shard.array
            return send
        for fp in self.params:
            if fp.shard.array is not fp.flat_view:  # rebound (`.data = ...`, a load): copy in
                fp.flat_view[...] = fp.shard.array
        return self._flat_shards

    # ------------------------------------------------------------------ unshard / reshard

    def _buffer(self) -> np.ndarray:
        if self._unsharded_buf is None:
            itemsize = np.dtype(self.param_dtype).itemsize
            self._map = mmap.mmap(-1, max(1, self.full_numel * itemsize),
                                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._unsharded_buf = np.frombuffer(self._map, dtype=self.param_dtype,
                                                count=self.full_numel)
        return self._unsharded_buf

    def gather_due(self) -> bool:
        """True when the group has shards to gather and is neither gathered nor in flight."""
        return bool(self.params) and not self.unsharded and self._gather is None

    def can_gather_with(self, other: "ParamGroup") -> bool:
        """Whether one all_gather can carry both groups' shards: the same ranks and dtype."""
        return other.pg is self.pg and other.param_dtype == self.param_dtype

    def start_unshard(self, partners: Sequence["ParamGroup"] = ()) -> None:
        """Issue the all_gather of the group's shards (asynchronous) unless done or in flight,
        with those of `partners` (groups this one `can_gather_with`) in the same collective.

        Alone, the gather sends the shards' own buffer; together, each rank sends the groups'
        shards end to end (one copy of them, cheaper than a collective's hand-off, barrier and
        wake-up) and each group copies its columns out of the rows received.
        """
        groups = [g for g in (self, *partners) if g.gather_due()]
        if not groups:
            return
        if len(groups) == 1:
            send = groups[0].send_buffer()
        else:
            send = np.concatenate([g.send_buffer() for g in groups])
        recv = np.empty((self.world, send.size), dtype=self.param_dtype)
        work = self.pg.all_gather_into_tensor(recv.reshape(-1), send, async_op=True)
        for g, cols in _columns(groups):
            # `send` stays referenced until the gather is waited for: the backend reads it late.
            # Alone, the group holds the buffer itself (its memory count knows its own shards).
            g.gathering(work, recv[:, cols], send if len(groups) == 1 else send[cols])

    def gathering(self, work: Any, blocks: np.ndarray, send: np.ndarray) -> None:
        """Hold the in-flight all_gather `work`, this group's columns of the rows it receives
        and its share of the send buffer."""
        self._gather = (work, blocks, send)

    def wait_unshard(self) -> None:
        """Finish the all_gather and lay each parameter out whole in the unsharded buffer."""
        if self.unsharded or not self.params:
            return
        self.start_unshard()
        work, blocks, _send = self._gather
        self._gather = None
        work.wait()
        buf = self._buffer()
        for fp in self.params:
            _gather_rows(blocks[:, fp.slot:fp.slot + fp.chunk], buf[fp.offset:fp.offset + fp.numel])
            if fp.full is None:
                view = buf[fp.offset:fp.offset + fp.numel].reshape(fp.shape)
                fp.full = Parameter(view, requires_grad=fp.shard.requires_grad)
                if fp.full.requires_grad:
                    fp.full.register_post_accumulate_grad_hook(self._grad_ready)
        self.unsharded = True

    def drop_gather(self) -> None:
        """Wait for an all_gather nobody will use (a prefetch after the last use in backward)
        and forget it: its values predate the optimizer step that comes next."""
        if self._gather is not None:
            work = self._gather[0]
            self._gather = None
            work.wait()

    def use_full(self) -> None:
        """Let the modules see the whole parameters (for forward)."""
        for fp in self.params:
            for owner, name in fp.owners:
                setattr(owner, name, fp.full)

    def use_shards(self) -> None:
        """Give the modules back their shards (between forwards, and what the optimizer sees)."""
        for fp in self.params:
            for owner, name in fp.owners:
                setattr(owner, name, fp.shard)

    def reshard(self) -> None:
        """Give the unsharded buffer's pages back to the kernel; graphs keep valid views."""
        if self.unsharded:
            _release_pages(self._map)
            self.unsharded = False

    def resident_bytes(self) -> int:
        """Bytes of unsharded parameters, their gradients (between backward and the
        reduce_scatter, or accumulated without sync) and in-flight collectives held now."""
        held = self._unsharded_buf.nbytes if self.unsharded else 0
        held += sum(fp.full.grad.array.nbytes for fp in self.params
                    if fp.full is not None and fp.full.grad is not None)
        if self._gather is not None:  # its send buffer is the shards' own, counted with them
            held += self._gather[1].nbytes
            held += 0 if self._gather[2] is self._flat_shards else self._gather[2].nbytes
        if self._reduce is not None:
            held += self._reduce[1].nbytes + self._reduce[2].nbytes
        return held

    # ------------------------------------------------------------------ gradients

    def _grad_ready(self, param: Parameter) -> None:
        self.ready += 1
        if self.ready == self.expected:
            self.grads_done = True
            self._on_grads_ready(self)

    def can_reduce_with(self, other: "ParamGroup") -> bool:
        """Whether one reduce_scatter can carry both groups' gradients: the same ranks, the
        same replicas and the same reduce dtype."""
        return (other.pg is self.pg and other.replicate is self.replicate
                and other.reduce_dtype == self.reduce_dtype)

    def start_reduce(self, partners: Sequence["ParamGroup"] = ()) -> None:
        """Pack the unsharded gradients and issue their reduce_scatter (asynchronous), with
        those of `partners` (groups this one `can_reduce_with`) in the same collective; a
        parameter that got no gradient contributes zeros.

        Together, each rank's row of the send buffer holds the groups' rows side by side, so
        the output is the groups' reduced shards end to end: one collective where there were
        several, each of which costs the backend a hand-off, a barrier and a wake-up.
        """
        groups = [g for g in (self, *partners) if g.reduce_due()]
        if not groups:
            return
        columns = _columns(groups)
        total = columns[-1][1].stop
        send = np.empty((self.world, total), dtype=self.reduce_dtype)
        out = np.empty(total, dtype=self.reduce_dtype)
        for g, cols in columns:
            g.pack_grads(send[:, cols])
        work = self.pg.reduce_scatter_tensor(out, send.reshape(-1), ReduceOp.SUM, async_op=True)
        for g, cols in columns:
            g.reducing(work, out[cols], send[:, cols])

    def reduce_due(self) -> bool:
        """Restart the count of ready gradients; True when the group has gradients to reduce
        and no reduce_scatter in flight."""
        self.ready = 0
        return bool(self.expected) and self._reduce is None

    def reducing(self, work: Any, out: np.ndarray, send: np.ndarray) -> None:
        """Hold the in-flight reduce_scatter `work` and this group's share of its output and
        send buffers (shares of a joint one are counted once between the groups)."""
        self._reduce = (work, out, send)

    def pack_grads(self, send: np.ndarray) -> None:
        """Lay the unsharded gradients out as the rows of `send` (W x send_numel) and drop
        them; zeros for a parameter without one."""
        self._no_local_grad = set()
        for index, fp in enumerate(self.params):
            block = send[:, fp.slot:fp.slot + fp.chunk]
            if fp.full is None or fp.full.grad is None:
                block[...] = 0
                self._no_local_grad.add(index)
                continue
            _scatter_rows(fp.full.grad.array.reshape(-1), block)
            fp.full.grad = None

    def finish_reduce(self) -> None:
        """Wait for the reduce_scatter and add the averaged shard gradients to `shard.grad`."""
        if self._reduce is None:
            return
        work, out, _send = self._reduce
        self._reduce = None
        work.wait()
        count = self.world
        if self.replicate is not None:  # hybrid: the shards' replicas average across hosts
            self.replicate.all_reduce(out, ReduceOp.SUM).wait()
            count *= self.replicate.size()
        out /= count
        for index, fp in enumerate(self.params):
            if not fp.shard.requires_grad:
                continue
            # A view of `out` where the dtypes agree: the shards' gradients share its memory.
            grad = out[fp.slot:fp.slot + fp.chunk].astype(fp.dtype, copy=False)
            if index in self._no_local_grad and not grad.any():
                continue  # no rank's backward reached it (as far as this chunk shows): None
            if fp.shard.grad is None:
                fp.shard.grad = Tensor(grad)
            else:
                fp.shard.grad.array += grad


def _release_pages(region: mmap.mmap) -> None:
    """MADV_FREE (Linux 4.5+, private anonymous memory), else MADV_DONTNEED."""
    global _FREE_ADVICE
    if _FREE_ADVICE is not None:
        try:
            region.madvise(_FREE_ADVICE)
            return
        except OSError:  # a kernel without it: EINVAL, once
            _FREE_ADVICE = None
    region.madvise(mmap.MADV_DONTNEED)


_FREE_ADVICE: Optional[int] = getattr(mmap, "MADV_FREE", None)


def _columns(groups: Sequence[ParamGroup]) -> list[tuple[ParamGroup, slice]]:
    """Each group's columns in a buffer that holds the groups' rows side by side (a joint
    all_gather's or reduce_scatter's), in order."""
    spans, at = [], 0
    for g in groups:
        spans.append((g, slice(at, at + g.send_numel)))
        at += g.send_numel
    return spans


def _scatter_rows(flat: np.ndarray, block: np.ndarray) -> None:
    """Lay `flat` out as the rows of `block` (W x chunk), zero-padding the tail, with no
    temporary: rank r's row is elements [r*chunk, (r+1)*chunk)."""
    chunk = block.shape[1]
    if chunk == 0:
        return  # an empty parameter
    whole = flat.size // chunk
    block[:whole] = flat[:whole * chunk].reshape(whole, chunk)
    if whole < block.shape[0]:
        rest = flat.size - whole * chunk
        block[whole, :rest] = flat[whole * chunk:]
        block[whole, rest:] = 0
        block[whole + 1:] = 0


def _gather_rows(block: np.ndarray, flat: np.ndarray) -> None:
    """The inverse of `_scatter_rows`: the rows of `block` (W x chunk) end to end into `flat`,
    without the padding and with no temporary."""
    chunk = block.shape[1]
    if chunk == 0:
        return
    whole = flat.size // chunk
    flat[:whole * chunk].reshape(whole, chunk)[...] = block[:whole]
    if whole < block.shape[0]:
        flat[whole * chunk:] = block[whole, :flat.size - whole * chunk]
