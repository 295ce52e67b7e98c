"""One pipeline stage: a submodule on this rank, and the messages to its neighbouring stages.

A stage receives its input activation from the stage before it, runs its submodule, and sends
the output on; in backward it receives the gradient of that output from the stage after it and
sends its input's gradient back. Shapes are not declared up front: each activation travels
behind a small header (dtype, rank, dimensions), so the receiver allocates the buffer the
tcp backend's fingerprint check expects, and micro-batches of different sizes work. A stage may
pass a tuple of tensors (a hidden state and a mask); every floating-point one gets a gradient
back, and a gradient has the shape of the activation it answers, so it needs no header.

Sends are asynchronous and receives block (with the stage's timeout): a group runs its
operations in submission order, and point-to-point messages land in the receiver's mailbox
whether or not it is waiting, so a send queued before a receive can never wait on that receive.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np

from shoal.collectives.p2p import isend, recv
from shoal.collectives.world import get_global_rank, get_rank, get_world_size, member_group
from shoal.core import autograd
from shoal.core.grad_mode import no_grad
from shoal.core.tensor import Tensor

__all__ = ["PipelineError", "PipelineStage"]

logger = logging.getLogger(__name__)

# Tags apart from any a user's own point-to-point messages are likely to use.
_TAG_HEADER, _TAG_ACTIVATION, _TAG_GRAD = 0x5E01, 0x5E02, 0x5E03
_MAX_DIMS = 8
_MAX_TENSORS = 8
_SLOT = 2 + _MAX_DIMS  # dtype, rank, dimensions
_DTYPES = tuple(np.dtype(n) for n in (
    "float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"))


class PipelineError(RuntimeError):
    """A pipeline stage or schedule was misused or its neighbours sent something unexpected."""


def _header(arrays: list) -> np.ndarray:
    """The number of tensors, then per tensor its dtype index, rank and dimensions (int64)."""
    if len(arrays) > _MAX_TENSORS:
        raise PipelineError(f"A stage passes at most {_MAX_TENSORS} tensors to the next; "
                            f"this one returned {len(arrays)}.")
    head = np.zeros(1 + _MAX_TENSORS * _SLOT, np.int64)
    head[0] = len(arrays)
    for i, arr in enumerate(arrays):
        if arr.dtype not in _DTYPES:
            raise PipelineError(
                f"A pipeline stage cannot send an activation of dtype {arr.dtype}; supported: "
                f"{', '.join(str(d) for d in _DTYPES)}.")
        if arr.ndim > _MAX_DIMS:
            raise PipelineError(f"A pipeline activation has {arr.ndim} dimensions; at most "
                                f"{_MAX_DIMS} are supported.")
        at = 1 + i * _SLOT
        head[at], head[at + 1] = _DTYPES.index(arr.dtype), arr.ndim
        head[at + 2:at + 2 + arr.ndim] = arr.shape
    return head


def _buffers_for(head: np.ndarray) -> list:
    """Empty arrays of the shapes and dtypes a header announces (None if it is malformed)."""
    count = int(head[0])
    if not 0 < count <= _MAX_TENSORS:
        return None
    out = []
    for i in range(count):
        at = 1 + i * _SLOT
        kind, ndim = int(head[at]), int(head[at + 1])
        dims = head[at + 2:at + 2 + ndim]
        if not 0 <= kind < len(_DTYPES) or not 0 <= ndim <= _MAX_DIMS or (dims < 0).any():
            return None
        out.append(np.empty(tuple(int(d) for d in dims), _DTYPES[kind]))
    return out


def _differentiable(t: Tensor) -> bool:
    return t.array.dtype.kind == "f"


class PipelineStage:
    """`submodule` as stage `stage_index` of `num_stages`, one stage per rank of `group`
    (torch.distributed.pipelining.PipelineStage; shapes are exchanged at run time, so
    input_args and output_args are optional and only checked when given)."""

    def __init__(self, submodule: Any, stage_index: int, num_stages: int, device: Any = "cpu",
                 input_args: Any = None, output_args: Any = None, group: Any = None,
                 timeout: Optional[float] = None) -> None:
        pg = member_group(group)
        if pg is None:
            raise PipelineError("PipelineStage: this rank is not a member of the stage group.")
        size = get_world_size(pg)
        if num_stages != size:
            raise PipelineError(
                f"PipelineStage: num_stages={num_stages} but the group has {size} ranks; one "
                "stage per rank is supported.")
        if not 0 <= stage_index < num_stages:
            raise PipelineError(f"PipelineStage: stage_index {stage_index} is outside "
                                f"[0, {num_stages}).")
        if get_rank(pg) != stage_index:
            raise PipelineError(
                f"PipelineStage: stage {stage_index} must run on rank {stage_index} of its "
                f"group; this is rank {get_rank(pg)}.")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = device
        self.group = pg
        self.timeout = timeout
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self._prev = None if self.is_first else get_global_rank(pg, stage_index - 1)
        self._next = None if self.is_last else get_global_rank(pg, stage_index + 1)
        self._expected = {"input": input_args, "output": output_args}
        self._chunks: dict[int, tuple[Any, Any]] = {}  # micro-batch -> (input, output)
        self._sends: list = []  # (work, array) until the step ends

    # -- forward -------------------------------------------------------------------------

    def forward_one_chunk(self, chunk_id: int, args: Any = None) -> Any:
        """Run the submodule on micro-batch `chunk_id` (args, a tensor or a tuple of them, on
        the first stage; received otherwise), keep what backward needs, and send the output
        (a tensor or a tuple of them) on."""
        if self.is_first:
            inputs = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        else:
            inputs = tuple(Tensor(a) for a in self._recv_activations())
            for t in inputs:
                t.requires_grad = _differentiable(t)
        self._check_expected("input", inputs[0])
        out = self.submod(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        if not outs or not all(isinstance(o, Tensor) for o in outs):
            raise PipelineError(
                f"Stage {self.stage_index}'s submodule returned {type(out).__name__}; a stage "
                "passes a tensor or a tuple of tensors to the next.")
        self._check_expected("output", outs[0])
        if not self.is_last:
            arrays = [np.ascontiguousarray(o.array) for o in outs]
            self._send(_header(arrays), self._next, _TAG_HEADER)
            for arr in arrays:
                self._send(arr, self._next, _TAG_ACTIVATION)
        self._chunks[chunk_id] = (inputs, outs)
        return out

    # -- backward ------------------------------------------------------------------------

    def backward_one_chunk(self, chunk_id: int, loss: Any = None) -> None:
        """Backpropagate micro-batch `chunk_id` (from `loss` on the last stage, from the
        gradients the next stage sends otherwise) and send its inputs' gradients back."""
        try:
            inputs, outs = self._chunks.pop(chunk_id)
        except KeyError:
            raise PipelineError(f"Stage {self.stage_index}: backward of micro-batch {chunk_id} "
                                "before its forward.") from None
        if self.is_last:
            if loss is None:
                raise PipelineError("The last stage's backward needs the micro-batch's loss.")
            loss.backward()
        else:
            roots, grads = [], []
            for o in outs:  # the next stage sends one gradient per floating-point tensor
                if not _differentiable(o):
                    continue
                grad = np.empty(o.array.shape, o.array.dtype)
                recv(grad, self._next, self.group, _TAG_GRAD, self.timeout)
                if o.requires_grad:
                    roots.append(o)
                    grads.append(grad)
            if roots:
                autograd.backward(roots, grads)
        if not self.is_first:
            for t in inputs:
                if _differentiable(t):
                    g = t.grad.array if t.grad is not None else np.zeros_like(t.array)
                    self._send(np.ascontiguousarray(g), self._prev, _TAG_GRAD)

    # -- the step's end ------------------------------------------------------------------

    def scale_grads(self, factor: float) -> None:
        """Divide the submodule's gradients by `factor` (the number of micro-batches)."""
        with no_grad():
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.array /= factor

    def finish_step(self) -> None:
        """Wait for every send of the step, and drop micro-batches that never ran backward."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait(self.timeout)
        self._chunks.clear()

    # -- messages ------------------------------------------------------------------------

    def _send(self, arr: np.ndarray, dst: int, tag: int) -> None:
        work = isend(arr, dst, self.group, tag, self.timeout)
        self._sends.append((work, arr))  # the array must live until the send has gone

    def _recv_activations(self) -> list:
        head = np.empty(1 + _MAX_TENSORS * _SLOT, np.int64)
        recv(head, self._prev, self.group, _TAG_HEADER, self.timeout)
        buffers = _buffers_for(head)
        if buffers is None:
            raise PipelineError(f"Stage {self.stage_index} received a malformed activation "
                                f"header from rank {self._prev}: {head.tolist()}.")
        for buf in buffers:
            recv(buf, self._prev, self.group, _TAG_ACTIVATION, self.timeout)
        return buffers

    def _check_expected(self, which: str, t: Any) -> None:
        want = self._expected[which]
        if want is None or not isinstance(t, Tensor):
            return
        want_shape = tuple(want.shape)
        if want_shape[1:] != tuple(t.shape)[1:]:
            raise PipelineError(
                f"Stage {self.stage_index}'s {which} has shape {tuple(t.shape)}; the stage was "
                f"declared with {which}_args of shape {want_shape} (the batch dimension may "
                "differ).")

    def __repr__(self) -> str:
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
                f"submod={type(self.submod).__name__})")
