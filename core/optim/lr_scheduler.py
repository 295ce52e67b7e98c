"""Learning-rate schedulers with torch's chainable semantics.

Each scheduler's `get_lr` computes the next rate from the group's current `lr` (recursive form),
so several schedulers stepped on one optimizer compose multiplicatively, as in torch:
ExponentialLR(gamma=0.9) with StepLR(step_size=3, gamma=0.1) on lr 0.1 gives
0.1, 0.09, 0.081, 0.00729, 0.006561.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable, Sequence

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

    def step(self) -> None:
        """Advance one epoch and set each group's 'lr'."""
        self._step_count += 1
        self.last_epoch += 1
        values = self.get_lr()
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


class StepLR(LRScheduler):
    """Multiply the rate by gamma every step_size epochs."""

    def __init__(
        self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        if int(step_size) != step_size or step_size < 1:
            raise SchedulerError(f"StepLR step_size must be a positive int; got {step_size!r}.")
        self.step_size = int(step_size)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._current_lrs()
        return [lr * self.gamma for lr in self._current_lrs()]


class ExponentialLR(LRScheduler):
    """Multiply the rate by gamma every epoch."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:
            return self._current_lrs()
        return [lr * self.gamma for lr in self._current_lrs()]


class CosineAnnealingLR(LRScheduler):
    """Anneal from the base rate to eta_min along half a cosine over T_max epochs, then back."""

    def __init__(
        self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        if T_max <= 0:
            raise SchedulerError(f"CosineAnnealingLR T_max must be positive; got {T_max!r}.")
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        epoch, t_max, eta_min = self.last_epoch, self.T_max, self.eta_min
        if self._is_initial:
            return self._current_lrs()
        if self._step_count == 1 and epoch > 0:
            # Resumed at an epoch: no previous rate to scale, so use the closed form.
            return [
                eta_min + (base - eta_min) * (1 + math.cos(epoch * math.pi / t_max)) / 2
                for base in self.base_lrs
            ]
        if (epoch - 1 - t_max) % (2 * t_max) == 0:
            # At the trough the recursive ratio divides by zero; step up by the first increment.
            return [
                lr + (base - eta_min) * (1 - math.cos(math.pi / t_max)) / 2
                for base, lr in zip(self.base_lrs, self._current_lrs())
            ]
        ratio = (1 + math.cos(math.pi * epoch / t_max)) / (1 + math.cos(math.pi * (epoch - 1) / t_max))
        return [ratio * (lr - eta_min) + eta_min for lr in self._current_lrs()]


class LambdaLR(LRScheduler):
    """Set each group's rate to its base rate times lr_lambda(epoch) (not chainable)."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
        last_epoch: int = -1,
    ) -> None:
        groups = len(optimizer.param_groups)
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != groups:
                raise SchedulerError(
                    f"LambdaLR got {len(lr_lambda)} lr_lambdas for an optimizer with {groups} "
                    "parameter groups; give one per group or a single one."
                )
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * groups
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs)]

    def state_dict(self) -> dict[str, Any]:
        """As the base, but plain functions are saved as None (callable objects: their dict)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [
            None if isinstance(fn, types.FunctionType) else dict(fn.__dict__)
            for fn in self.lr_lambdas
        ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule; callable objects get their saved attributes back."""
        state = dict(state_dict)
        saved = state.pop("lr_lambdas", [None] * len(self.lr_lambdas))
        if len(saved) != len(self.lr_lambdas):
            raise SchedulerError(
                f"LambdaLR.load_state_dict: {len(saved)} saved lr_lambdas for "
                f"{len(self.lr_lambdas)} parameter groups."
            )
        state["lr_lambdas"] = self.lr_lambdas
        super().load_state_dict(state)
        for fn, attrs in zip(self.lr_lambdas, saved):
            if attrs is not None:
                fn.__dict__.update(attrs)


class LinearLR(LRScheduler):
    """Scale the rate linearly from start_factor to end_factor over total_iters epochs."""

    def __init__(
        self,
        optimizer: Optimizer,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        if not 0.0 < start_factor <= 1.0:
            raise SchedulerError(f"LinearLR start_factor must be in (0, 1]; got {start_factor}.")
        if not 0.0 <= end_factor <= 1.0:
            raise SchedulerError(f"LinearLR end_factor must be in [0, 1]; got {end_factor}.")
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in self._current_lrs()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._current_lrs()
        delta = self.end_factor - self.start_factor
        factor = 1.0 + delta / (
            self.total_iters * self.start_factor + (self.last_epoch - 1) * delta
        )
        return [lr * factor for lr in self._current_lrs()]


class ChainedScheduler(LRScheduler):
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
                f"ChainedScheduler.load_state_dict: saved state holds {count} schedulers but "
                f"this chain has {len(self._schedulers)}."
            )
        self.__dict__.update(state)
        for scheduler, entry in zip(self._schedulers, saved):
            scheduler.load_state_dict(entry)
