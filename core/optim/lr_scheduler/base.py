"""`LRScheduler`, the base of every scheduler, and `SchedulerError`.

Each scheduler's `get_lr` computes the next rate from the group's current `lr` (recursive form),
so several schedulers stepped on one optimizer compose multiplicatively, as in torch:
ExponentialLR(gamma=0.9) with StepLR(step_size=3, gamma=0.1) on lr 0.1 gives
0.1, 0.09, 0.081, 0.00729, 0.006561.
"""

from __future__ import annotations

import warnings
from typing import Any

from shoal.core.errors import ShoalError
from shoal.core.optim.optimizer import Optimizer


class SchedulerError(ShoalError, ValueError):
    """Bad scheduler arguments or a scheduler state_dict that does not fit."""


class LRScheduler:
    """Base class: `step()` advances `last_epoch` and writes `get_lr()` into each group."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise SchedulerError(
                f"{type(self).__name__} needs a core.optim.Optimizer; got "
                f"{type(optimizer).__name__}."
            )
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for index, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise SchedulerError(
                        f"{type(self).__name__}(last_epoch={last_epoch}) resumes a schedule, "
                        f"but param_groups[{index}] has no 'initial_lr': load the optimizer's "
                        "state_dict first, or start with last_epoch=-1."
                    )
        self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._is_initial = False
        self._initial_step()

    def _initial_step(self) -> None:
        """The step every scheduler takes when built (SequentialLR repeats it for its next)."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The next learning rate of each parameter group (called by step())."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates the last step() set."""
        return self._last_lr

    def step(self, epoch: int | None = None) -> None:
        """Advance one epoch and set each group's 'lr' (an explicit `epoch` is deprecated in
        torch: it jumps there, by the closed form where the schedule has one)."""
        self._step_count += 1
        if epoch is not None:
            warnings.warn(
                "The epoch parameter in `scheduler.step()` was not necessary and is being "
                "deprecated where possible. Please use `scheduler.step()` to step the "
                "scheduler.", UserWarning, stacklevel=2,
            )
        self._update_lr(epoch)

    def _update_lr(self, epoch: int | None = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed = getattr(self, "_get_closed_form_lr", None)
            values = closed() if closed is not None else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _current_lrs(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Every attribute except the optimizer, as torch."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore attributes saved by state_dict(); unknown or missing keys are an error."""
        own = set(self.state_dict())
        given = set(state_dict)
        if own != given:
            raise SchedulerError(
                f"{type(self).__name__}.load_state_dict: missing keys {sorted(own - given)}, "
                f"unexpected keys {sorted(given - own)}."
            )
        self.__dict__.update(state_dict)


