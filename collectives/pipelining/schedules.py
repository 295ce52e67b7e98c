"""Pipeline schedules: the order in which a stage runs its micro-batches' forwards and backwards.

`schedule.step(x, target=y, losses=losses)` splits the batch into `n_microbatches` along its
first dimension (the first stage splits the inputs, the last stage the targets), runs the
schedule, and leaves in each stage's parameters the gradient of the mean of the micro-batches'
losses (torch's `scale_grads=True`): with a mean-reduced loss and equal micro-batches that is
the whole batch's gradient, summed in another order. The last stage returns the outputs
joined along the batch dimension and appends each micro-batch's loss to `losses`.

GPipe runs every forward, then every backward: each stage holds all M micro-batches'
activations, and idles (S-1)/(M+S-1) of the step. 1F1B starts the backwards as soon as the last
stage can: stage s runs S-s-1 forwards ahead, then alternates one forward and one backward, so
it holds at most S-s micro-batches' activations at once, with the same bubble.

Data parallelism composes as a 2D layout: the stage's group is one pipeline (new_group over one
rank per stage) and the stage's submodule is a DistributedDataParallel over the ranks that hold
the same stage. Every micro-batch then runs under the DDP's no_sync(), and after the last
backward the accumulated gradients are averaged over its group in one flat all_reduce, once per
step, as DDP without a pipeline would average them (the DDP's comm hook is not used here).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from shoal.collectives.ddp.ddp import DistributedDataParallel
from shoal.collectives.pipelining.stage import PipelineError, PipelineStage
from shoal.collectives.tensor_collectives import all_reduce
from shoal.collectives.types import ReduceOp
from shoal.core.ops.shape import cat
from shoal.core.tensor import Tensor

__all__ = ["PipelineScheduleSingle", "Schedule1F1B", "ScheduleGPipe", "split_microbatches"]


def split_microbatches(x: Any, n: int) -> list:
    """`x` cut into n pieces along dimension 0 (sizes differ by at most one, as
    torch.tensor_split); None gives n Nones."""
    if x is None:
        return [None] * n
    if not isinstance(x, Tensor):
        raise PipelineError(f"A pipeline step splits tensors, got {type(x).__name__}.")
    rows = x.shape[0]
    if rows < n:
        raise PipelineError(f"A batch of {rows} rows cannot be split into {n} micro-batches.")
    q, r = divmod(rows, n)
    bounds = np.cumsum([0] + [q + 1] * r + [q] * (n - r))
    return [x[int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:])]


class PipelineScheduleSingle:
    """A schedule over one stage per rank (torch's PipelineScheduleSingle)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                 scale_grads: bool = True) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"A schedule needs a PipelineStage, got {type(stage).__name__}.")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}.")
        self._stage = stage
        self._n_microbatches = int(n_microbatches)
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._targets: list = []
        self._losses: list = []
        self._outputs: list = []

    def step(self, *args: Any, target: Any = None, losses: Optional[list] = None,
             return_outputs: bool = True, **kwargs: Any) -> Any:
        """Run one batch through the pipeline; the last stage returns its joined outputs
        (None with return_outputs=False)."""
        stage, m = self._stage, self._n_microbatches
        if kwargs:
            raise PipelineError(f"step() got keyword arguments {sorted(kwargs)}; a stage takes "
                                "positional tensors.")
        if stage.is_first and not args:
            raise PipelineError("The first stage's step() takes the batch: one or more tensors, "
                                "split along their first dimension.")
        if stage.is_last and self._loss_fn is not None and target is None:
            raise PipelineError("The last stage's step() needs target= when the schedule has "
                                "a loss_fn.")
        inputs = list(zip(*(split_microbatches(a, m) for a in args))) if stage.is_first \
            else [None] * m
        self._targets = split_microbatches(target if stage.is_last else None, m)
        self._losses, self._outputs = [], []
        ddp = stage.submod if isinstance(stage.submod, DistributedDataParallel) else None
        try:
            if ddp is not None:
                with ddp.no_sync():
                    self._run(inputs)
            else:
                self._run(inputs)
        finally:
            stage.finish_step()
        if self.scale_grads:
            stage.scale_grads(m)
        if ddp is not None:
            _average_gradients(ddp)
        if losses is not None and stage.is_last:
            losses.extend(self._losses)
        if stage.is_last and return_outputs:
            if isinstance(self._outputs[0], tuple):
                return tuple(cat(list(parts), 0) for parts in zip(*self._outputs))
            return cat(self._outputs, 0)
        return None

    def _run(self, inputs: list) -> None:
        raise NotImplementedError

    def _forward(self, i: int, inputs: list) -> None:
        stage = self._stage
        out = stage.forward_one_chunk(i, inputs[i])
        if stage.is_last:
            self._outputs.append(tuple(o.detach() for o in out) if isinstance(out, tuple)
                                 else out.detach())
            if self._loss_fn is not None:
                self._losses.append(self._loss_fn(out, self._targets[i]))

    def _backward(self, i: int) -> None:
        loss = None
        if self._stage.is_last:
            if self._loss_fn is None:
                raise PipelineError("Backward through a pipeline needs the schedule's loss_fn.")
            loss = self._losses[i]
            self._losses[i] = loss.detach()
        self._stage.backward_one_chunk(i, loss)


class ScheduleGPipe(PipelineScheduleSingle):
    """Every micro-batch's forward, then every backward (GPipe)."""

    def _run(self, inputs: list) -> None:
        for i in range(self._n_microbatches):
            self._forward(i, inputs)
        if self._loss_fn is None and self._stage.is_last:
            return  # inference: nothing to backpropagate
        for i in range(self._n_microbatches):
            self._backward(i)


class Schedule1F1B(PipelineScheduleSingle):
    """A warm-up of forwards, then one forward and one backward in turn, then the remaining
    backwards (1F1B, PipeDream-flush): at most S - s micro-batches in flight on stage s."""

    def _run(self, inputs: list) -> None:
        m, stage = self._n_microbatches, self._stage
        warmup = min(stage.num_stages - stage.stage_index - 1, m)
        for i in range(warmup):
            self._forward(i, inputs)
        for i in range(warmup, m):
            self._forward(i, inputs)
            self._backward(i - warmup)
        for i in range(m - warmup, m):
            self._backward(i)


def _average_gradients(ddp: DistributedDataParallel) -> None:
    """Average the stage's accumulated gradients over the DDP's group with one all_reduce."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = Tensor(np.zeros_like(p.array))
    flat = np.concatenate([p.grad.array.ravel() for p in params]) if params else None
    if flat is None:
        return
    all_reduce(flat, ReduceOp.SUM, group=ddp.process_group)
    flat /= ddp.process_group.size()
    offset = 0
    for p in params:
        n = p.grad.array.size
        p.grad.array[...] = flat[offset:offset + n].reshape(p.grad.array.shape)
        offset += n
