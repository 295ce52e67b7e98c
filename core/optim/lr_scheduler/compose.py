"""Schedulers made of schedulers: ChainedScheduler and SequentialLR, as torch's."""

from __future__ import annotations

import bisect
from typing import Any, Sequence

from shoal.core.optim.lr_scheduler.base import LRScheduler, SchedulerError
from shoal.core.optim.lr_scheduler.plateau import ReduceLROnPlateau
from shoal.core.optim.optimizer import Optimizer


class _Composite(LRScheduler):
    """What ChainedScheduler and SequentialLR share: their schedulers' states in their own."""

    _schedulers: list[LRScheduler]

    def state_dict(self) -> dict[str, Any]:
        """Own attributes plus each chained scheduler's state_dict under '_schedulers'."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore own attributes and each chained scheduler's state."""
        state = dict(state_dict)
        saved = state.pop("_schedulers", None)
        if saved is None or len(saved) != len(self._schedulers):
            count = None if saved is None else len(saved)
            raise SchedulerError(
                f"{type(self).__name__}.load_state_dict: saved state holds {count} schedulers but "
                f"this one has {len(self._schedulers)}."
            )
        self.__dict__.update(state)
        for scheduler, entry in zip(self._schedulers, saved):
            scheduler.load_state_dict(entry)


class ChainedScheduler(_Composite):
    """Step several schedulers of one optimizer together, each on the rate the last one set."""

    def __init__(
        self, schedulers: Sequence[LRScheduler], optimizer: Optimizer | None = None
    ) -> None:
        if len(schedulers) < 1:
            raise SchedulerError("ChainedScheduler needs at least one scheduler to chain.")
        optimizer = optimizer or schedulers[0].optimizer
        for index, scheduler in enumerate(schedulers):
            if getattr(scheduler, "optimizer", None) is not optimizer:
                raise SchedulerError(
                    f"ChainedScheduler needs every scheduler on one optimizer, but scheduler "
                    f"{index} ({type(scheduler).__name__}) steps a different one."
                )
        self._schedulers = list(schedulers)
        self.optimizer = optimizer
        self._last_lr = self._current_lrs()

    def step(self) -> None:
        """Step every chained scheduler in order."""
        for scheduler in self._schedulers:
            scheduler.step()
        self._last_lr = self._current_lrs()


class SequentialLR(_Composite):
    """Run schedulers one after another, switching at the milestone epochs."""

    def __init__(
        self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
        last_epoch: int = -1,
    ) -> None:
        if len(schedulers) < 1:
            raise SchedulerError(
                "SequentialLR expects at least one scheduler, but got no scheduler."
            )
        for index, scheduler in enumerate(schedulers):
            if not hasattr(scheduler, "optimizer"):
                raise TypeError(
                    f"SequentialLR at index {index} should have `optimizer` as its attribute."
                )
            if isinstance(scheduler, ReduceLROnPlateau):
                raise SchedulerError(
                    "SequentialLR does not support `ReduceLROnPlateau` scheduler as it requires "
                    "additional kwargs to be specified when calling `step`, but got one at "
                    f"index {index} in the given schedulers sequence."
                )
            if scheduler.optimizer is not optimizer:
                raise SchedulerError(
                    "SequentialLR expects all schedulers to belong to the same optimizer, but "
                    f"got scheduler {type(scheduler).__name__} at index {index} with a "
                    "different one."
                )
        if len(milestones) != len(schedulers) - 1:
            raise SchedulerError(
                "Sequential Schedulers expects number of schedulers provided to be one more "
                "than the number of milestone points, but got number of schedulers "
                f"{len(schedulers)} and the number of milestones to be equal to {len(milestones)}"
            )
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        # Each scheduler stepped once when built; undo that, and start the first one afresh.
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        self._undo(self)
        first = self._schedulers[bisect.bisect_right(self._milestones, 0)]
        first._initial_step()  # noqa: SLF001 - the base class's own step protocol
        self._last_lr = first.get_last_lr()

    def _undo(self, scheduler: Any) -> None:
        if hasattr(scheduler, "_schedulers"):
            for inner in scheduler._schedulers:  # noqa: SLF001 - composites of this module
                self._undo(inner)
        elif hasattr(scheduler, "last_epoch"):
            scheduler.last_epoch -= 1

    def step(self) -> None:  # type: ignore[override]
        """Step the scheduler whose stretch this epoch is in; at a milestone, restart it."""
        self.last_epoch += 1
        index = bisect.bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[index]
        if index > 0 and self._milestones[index - 1] == self.last_epoch:
            scheduler._update_lr(0)  # noqa: SLF001 - restart at its epoch 0, as torch does
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()
