"""Collectives that torch offers and shoal composes from its own: single-tensor all_to_all and
reduce_scatter, the object collectives gather/scatter, coalesced calls, and the torch
ProcessGroup's C++-style methods (`allreduce([t], opts)`, `allgather`, `alltoall`, ...).

`CompositeCollectives` is a base of `ProcessGroup`: every method here is written with what
`CollectivesHost` declares (the group's public collectives and one hook that hands back a
finished Work), so each backend gets them without writing anything.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from shoal.collectives import arrays
from shoal.collectives.types import ReduceOp
from shoal.core.errors import ShapeError
from shoal.core.timeouts import TimeoutLike


def _split_rows(arr, sizes: Optional[Sequence[int]], world: int, what: str) -> list:
    """Views of `arr`'s blocks of rows (dim 0) for each rank: equal, or `sizes` rows each."""
    rows = arr.shape[0] if arr.ndim else 1
    if sizes is None or len(sizes) == 0:
        if rows % world:
            raise ValueError(
                f"{what} has {rows} rows, which do not split evenly over {world} ranks; pass "
                "split sizes."
            )
        sizes = [rows // world] * world
    sizes = [int(k) for k in sizes]
    if len(sizes) != world or any(k < 0 for k in sizes) or sum(sizes) != rows:
        raise ValueError(
            f"{what} split sizes must be {world} non-negative row counts summing to {rows}, got "
            f"{list(sizes)}."
        )
    row = int(np.prod(arr.shape[1:], dtype=np.int64)) if arr.ndim else 1
    flat = arr.reshape(-1)
    tail = tuple(arr.shape[1:])
    views, start = [], 0
    for k in sizes:
        views.append(flat[start * row:(start + k) * row].reshape((k,) + tail))
        start += k
    return views


def _timeout_of(opts: Any) -> TimeoutLike:
    timeout = getattr(opts, "timeout", None)
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() <= 0:
        return None  # torch's "not set" (kUnsetTimeout)
    return timeout


def _op_of(opts: Any) -> Any:
    if opts is None:
        return ReduceOp.SUM
    if isinstance(opts, (ReduceOp, str)) or hasattr(opts, "factor"):
        return opts
    return getattr(opts, "reduceOp", ReduceOp.SUM)


def _root_of(opts: Any) -> int:
    return int(getattr(opts, "rootRank", 0) or 0)


def _is_list(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def _one(tensors: Any, what: str):
    """torch's list-of-one-tensor argument (one per device), or a bare tensor."""
    if isinstance(tensors, (list, tuple)):
        if len(tensors) != 1:
            raise ValueError(f"{what} takes a list of one tensor on the host, got {len(tensors)}.")
        return tensors[0]
    return tensors


class CollectivesHost(Protocol):
    """What `CompositeCollectives` needs from the class it is mixed into (`ProcessGroup`):
    the public collectives, with their documented meaning, and one hook."""

    def rank(self) -> int:
        """This process's rank in the group."""

    def size(self) -> int:
        """Number of ranks in the group."""

    def all_reduce(self, tensor, op: Any = ReduceOp.SUM, async_op: bool = False,
                   timeout: TimeoutLike = None) -> Any:
        """Reduce `tensor` across ranks in place."""

    def broadcast(self, tensor, src: int = 0, async_op: bool = False,
                  timeout: TimeoutLike = None) -> Any:
        """Copy rank `src`'s `tensor` into every rank's."""

    def reduce(self, tensor, dst: int = 0, op: Any = ReduceOp.SUM, async_op: bool = False,
               timeout: TimeoutLike = None) -> Any:
        """Reduce `tensor` across ranks into rank `dst`'s."""

    def all_gather(self, tensor_list: Sequence, tensor, async_op: bool = False,
                   timeout: TimeoutLike = None) -> Any:
        """Fill `tensor_list[j]` with rank j's `tensor`."""

    def all_gather_into_tensor(self, output, input,  # noqa: A002 - torch's parameter name
                               async_op: bool = False,
                               timeout: TimeoutLike = None) -> Any:
        """Concatenate every rank's `input` into `output`."""

    def gather(self, tensor, gather_list: Optional[Sequence] = None, dst: int = 0,
               async_op: bool = False, timeout: TimeoutLike = None) -> Any:
        """Collect every rank's `tensor` into `gather_list` on rank `dst`."""

    def scatter(self, tensor, scatter_list: Optional[Sequence] = None, src: int = 0,
                async_op: bool = False, timeout: TimeoutLike = None) -> Any:
        """Rank `src` sends `scatter_list[j]` to rank j's `tensor`."""

    def reduce_scatter(self, output, input_list: Sequence, op: Any = ReduceOp.SUM,
                       async_op: bool = False, timeout: TimeoutLike = None) -> Any:
        """Reduce `input_list[j]` across ranks into rank j's `output`."""

    def all_to_all(self, output_list: Sequence, input_list: Sequence, async_op: bool = False,
                   timeout: TimeoutLike = None, *, result: Optional[list] = None) -> Any:
        """Send `input_list[j]` to rank j's `output_list[i]`; the Work's result (and Future)
        hold `result` when given, else `output_list`."""

    def _completed_work(self, result: list) -> Any:
        """A Work that already finished with `result` (what the calls that run several
        collectives before returning hand back)."""


class CompositeCollectives:
    """torch's composite collectives, written with the group's own (see the module's doc).
    Its host must be a `CollectivesHost`; the methods read nothing else of it.

    Calls that run several collectives (coalesced, object collectives) run them before
    returning, and return a completed Work even when asked for async_op.
    """

    # -- single-tensor forms

    def reduce_scatter_tensor(self, output, input,  # noqa: A002 - torch's parameter name
                              op: Any = ReduceOp.SUM, async_op: bool = False,
                              timeout: TimeoutLike = None):
        """`output` := the reduction over ranks of this rank's block of every rank's `input`
        (`input` holds world_size blocks of `output`'s size, end to end)."""
        out = arrays.unwrap(output, "reduce_scatter_tensor output")
        inp = arrays.unwrap(input, "reduce_scatter_tensor input")
        world = self.size()
        if inp.dtype != out.dtype or inp.size != out.size * world:
            raise ShapeError(
                f"reduce_scatter_tensor input is {arrays.describe(inp)} but must hold {world} x "
                f"{arrays.describe(out)} (one output-sized block per rank)."
            )
        flat = inp.reshape(-1)
        blocks = [flat[i * out.size:(i + 1) * out.size].reshape(out.shape) for i in range(world)]
        return self.reduce_scatter(output, blocks, op, async_op=async_op, timeout=timeout)

    def all_gather_single(self, output, input,  # noqa: A002 - torch's parameter name
                          async_op: bool = False, timeout: TimeoutLike = None):
        """`all_gather_into_tensor` by the name the issue used."""
        return self.all_gather_into_tensor(output, input, async_op=async_op, timeout=timeout)

    def all_to_all_single(self, output, input,  # noqa: A002 - torch's parameter name
                          output_split_sizes: Optional[Sequence[int]] = None,
                          input_split_sizes: Optional[Sequence[int]] = None, async_op: bool = False,
                          timeout: TimeoutLike = None):
        """Rank j receives this rank's j-th block of rows of `input` into its i-th block of
        `output` (blocks equal, or as the split sizes say), as torch's all_to_all_single."""
        out = arrays.unwrap(output, "all_to_all_single output")
        inp = arrays.unwrap(input, "all_to_all_single input")
        arrays.check_same_dtype(out, inp, "all_to_all_single output", "input")
        world = self.size()
        outs = _split_rows(out, output_split_sizes, world, "all_to_all_single output")
        ins = _split_rows(inp, input_split_sizes, world, "all_to_all_single input")
        # `output` itself is the result, so that the Work and its Future hold the output
        # tensor, as torch's do, not this call's views of its rows.
        return self.all_to_all(outs, ins, async_op=async_op, timeout=timeout, result=[output])

    # -- object collectives

    def gather_object(self, obj: Any, object_gather_list: Optional[list] = None, dst: int = 0,
                      timeout: TimeoutLike = None) -> None:
        """Fill `object_gather_list` on rank `dst` with every rank's picklable `obj`."""
        world = self.size()
        if self.rank() == dst and (object_gather_list is None or len(object_gather_list) < world):
            raise ValueError(
                f"gather_object needs an object_gather_list of {world} slots on the destination "
                f"rank {dst}."
            )
        data = arrays.pickle_to_array(obj)
        sizes = [np.zeros(1, dtype=np.int64) for _ in range(world)]
        self.all_gather(sizes, np.array([data.size], dtype=np.int64), timeout=timeout)
        longest = int(max(int(s[0]) for s in sizes))
        padded = np.zeros(longest, dtype=np.uint8)
        padded[:data.size] = data
        outs = None
        if self.rank() == dst:
            outs = [np.empty(longest, dtype=np.uint8) for _ in range(world)]
        self.gather(padded, outs, dst=dst, timeout=timeout)
        if outs is not None:
            for i, (o, s) in enumerate(zip(outs, sizes)):
                object_gather_list[i] = arrays.array_to_object(o[:int(s[0])])

    def scatter_object_list(self, scatter_object_output_list: list,
                            scatter_object_input_list: Optional[list] = None, src: int = 0,
                            timeout: TimeoutLike = None) -> None:
        """Rank `src` sends `scatter_object_input_list[j]` to rank j, which finds it in its
        `scatter_object_output_list[0]`."""
        world = self.size()
        if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
            raise ValueError("scatter_object_output_list must be a non-empty list.")
        if self.rank() == src:
            given = scatter_object_input_list
            if given is None or len(given) != world:
                raise ValueError(
                    f"scatter_object_list needs {world} objects on the source rank {src}, got "
                    f"{None if given is None else len(given)}."
                )
            blobs = [arrays.pickle_to_array(o) for o in scatter_object_input_list]
            sizes = np.array([b.size for b in blobs], dtype=np.int64)
        else:
            sizes = np.zeros(world, dtype=np.int64)
        self.broadcast(sizes, src=src, timeout=timeout)
        longest = int(sizes.max())
        ins = None
        if self.rank() == src:
            ins = [np.zeros(longest, dtype=np.uint8) for _ in range(world)]
            for block, blob in zip(ins, blobs):
                block[:blob.size] = blob
        mine = np.empty(longest, dtype=np.uint8)
        self.scatter(mine, ins, src=src, timeout=timeout)
        scatter_object_output_list[0] = arrays.array_to_object(mine[:int(sizes[self.rank()])])

    # -- coalesced: one collective for many tensors

    def all_reduce_coalesced(self, tensors: Sequence, op: Any = ReduceOp.SUM,
                             async_op: bool = False, timeout: TimeoutLike = None):
        """Reduce every tensor of `tensors` in place with one all_reduce per dtype."""
        arrs = [arrays.unwrap(t, f"all_reduce_coalesced tensors[{i}]")
                for i, t in enumerate(tensors)]
        by_kind: dict[Any, list[int]] = {}
        for i, a in enumerate(arrs):
            by_kind.setdefault((a.dtype, type(a)), []).append(i)
        for members in by_kind.values():
            xp = _module_of(arrs[members[0]])
            flat = xp.concatenate([arrs[i].reshape(-1) for i in members])
            self.all_reduce(flat, op, timeout=timeout)
            start = 0
            for i in members:
                n = arrs[i].size
                arrs[i].reshape(-1)[...] = flat[start:start + n]
                start += n
        return self._completed_work(list(tensors))

    def all_gather_coalesced(self, output_tensor_lists: Sequence[Sequence],
                             input_tensor_list: Sequence, async_op: bool = False,
                             timeout: TimeoutLike = None):
        """`output_tensor_lists[r][i]` := rank r's `input_tensor_list[i]` (one all_gather per
        dtype)."""
        world = self.size()
        if len(output_tensor_lists) != world:
            raise ValueError(
                f"all_gather_coalesced needs {world} output lists (one per rank), got "
                f"{len(output_tensor_lists)}."
            )
        ins = [arrays.unwrap(t, f"all_gather_coalesced input_tensor_list[{i}]")
               for i, t in enumerate(input_tensor_list)]
        outs = []
        for r, row in enumerate(output_tensor_lists):
            what = f"all_gather_coalesced output_tensor_lists[{r}]"
            got = arrays.unwrap_list(row, what, len(ins))
            arrays.same_layout_pairs(got, ins, what)
            outs.append(got)
        by_kind: dict[Any, list[int]] = {}
        for i, a in enumerate(ins):
            by_kind.setdefault((a.dtype, type(a)), []).append(i)
        for members in by_kind.values():
            xp = _module_of(ins[members[0]])
            flat = xp.concatenate([ins[i].reshape(-1) for i in members])
            gathered = [xp.empty_like(flat) for _ in range(world)]
            self.all_gather(gathered, flat, timeout=timeout)
            for r in range(world):
                start = 0
                for i in members:
                    n = ins[i].size
                    outs[r][i].reshape(-1)[...] = gathered[r][start:start + n]
                    start += n
        return self._completed_work([list(row) for row in output_tensor_lists])

    # -- torch's ProcessGroup methods (C++ style: lists of one tensor per device, options)

    def allreduce(self, tensors: Any, opts: Any = None):
        """`pg.allreduce([t], opts)`: an async all_reduce (several tensors: coalesced)."""
        if isinstance(tensors, (list, tuple)) and len(tensors) > 1:
            return self.all_reduce_coalesced(list(tensors), _op_of(opts), timeout=_timeout_of(opts))
        return self.all_reduce(_one(tensors, "allreduce"), _op_of(opts), async_op=True,
                               timeout=_timeout_of(opts))

    def allreduce_coalesced(self, tensors: Sequence, opts: Any = None):
        """`pg.allreduce_coalesced(tensors, opts)`."""
        return self.all_reduce_coalesced(list(tensors), _op_of(opts), timeout=_timeout_of(opts))

    def allgather(self, output_tensors: Sequence[Sequence], input_tensors: Any, opts: Any = None):
        """`pg.allgather([[outs...]], [t], opts)`: an async all_gather."""
        outs = _one(output_tensors, "allgather output_tensors") if (
            output_tensors and isinstance(output_tensors[0], (list, tuple))) else output_tensors
        return self.all_gather(outs, _one(input_tensors, "allgather input_tensors"),
                               async_op=True, timeout=_timeout_of(opts))

    def _allgather_base(self, output, input,  # noqa: A002 - torch's parameter name
                        opts: Any = None):
        """`pg._allgather_base(out, in)`: all_gather_into_tensor, async."""
        return self.all_gather_into_tensor(output, input, async_op=True, timeout=_timeout_of(opts))

    def allgather_into_tensor_coalesced(self, outputs: Sequence, inputs: Sequence,
                                        opts: Any = None):
        """One all_gather_into_tensor per pair (torch's coalesced form)."""
        for out, inp in zip(outputs, inputs):
            self.all_gather_into_tensor(out, inp, timeout=_timeout_of(opts))
        return self._completed_work(list(outputs))

    def _reduce_scatter_base(self, output, input,  # noqa: A002 - torch's parameter name
                             opts: Any = None):
        """`pg._reduce_scatter_base(out, in, opts)`: reduce_scatter_tensor, async."""
        return self.reduce_scatter_tensor(output, input, _op_of(opts), async_op=True,
                                          timeout=_timeout_of(opts))

    # torch's list forms of the methods shoal also has with one tensor: the public methods of
    # collectives.api.ProcessGroup hand these over when their first argument is a list (always async, as torch's).

    def _torch_broadcast(self, tensors: Sequence, opts: Any):
        return self.broadcast(_one(tensors, "broadcast"), _root_of(opts), async_op=True,
                              timeout=_timeout_of(opts))

    def _torch_reduce(self, tensors: Sequence, opts: Any):
        return self.reduce(_one(tensors, "reduce"), _root_of(opts), _op_of(opts), async_op=True,
                           timeout=_timeout_of(opts))

    def _torch_gather(self, output_tensors: Sequence, input_tensors: Sequence, opts: Any):
        outs = _one(output_tensors, "gather output_tensors") if output_tensors else None
        return self.gather(_one(input_tensors, "gather input_tensors"), outs, _root_of(opts),
                           async_op=True, timeout=_timeout_of(opts))

    def _torch_scatter(self, output_tensors: Sequence, input_tensors: Sequence, opts: Any):
        ins = _one(input_tensors, "scatter input_tensors") if input_tensors else None
        return self.scatter(_one(output_tensors, "scatter output_tensors"), ins, _root_of(opts),
                            async_op=True, timeout=_timeout_of(opts))

    def _torch_reduce_scatter(self, output_tensors: Sequence, input_tensors: Sequence, opts: Any):
        return self.reduce_scatter(_one(output_tensors, "reduce_scatter output_tensors"),
                                   _one(input_tensors, "reduce_scatter input_tensors"),
                                   _op_of(opts), async_op=True, timeout=_timeout_of(opts))

    def alltoall(self, output_tensors: Sequence, input_tensors: Sequence, opts: Any = None):
        """`pg.alltoall(outs, ins, opts)`: an async all_to_all."""
        return self.all_to_all(output_tensors, input_tensors, async_op=True,
                               timeout=_timeout_of(opts))

    def alltoall_base(self, output, input,  # noqa: A002 - torch's parameter name
                      output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None):
        """`pg.alltoall_base(out, in, out_splits, in_splits, opts)`: all_to_all_single, async."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      async_op=True, timeout=_timeout_of(opts))


def _module_of(arr) -> Any:
    if arrays.is_cupy(arr):
        import cupy  # noqa: PLC0415  (only for cupy arrays, which imply cupy is there)

        return cupy
    return np

