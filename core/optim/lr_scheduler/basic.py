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


class OneCycleLR(LRScheduler):
    """The 1cycle policy: warm up to max_lr, then anneal far below the start (torch's phases).

    Momentum (SGD's `momentum`, or Adam's first beta) cycles the other way when cycle_momentum.
    """

    def __init__(
        self, optimizer: Optimizer, max_lr: float | Sequence[float],
        total_steps: int | None = None, epochs: int | None = None,
        steps_per_epoch: int | None = None, pct_start: float = 0.3,
        anneal_strategy: str = "cos", cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.85,
        max_momentum: float | Sequence[float] = 0.95, div_factor: float = 25.0,
        final_div_factor: float = 1e4, three_phase: bool = False, last_epoch: int = -1,
    ) -> None:
        if total_steps is None:
            if epochs is None or steps_per_epoch is None or epochs <= 0 or steps_per_epoch <= 0:
                raise SchedulerError(
                    "OneCycleLR needs total_steps, or positive epochs and steps_per_epoch; got "
                    f"total_steps={total_steps}, epochs={epochs}, steps_per_epoch={steps_per_epoch}."
                )
            total_steps = epochs * steps_per_epoch
        if total_steps <= 0:
            raise SchedulerError(f"OneCycleLR total_steps must be positive; got {total_steps}.")
        if not 0.0 <= pct_start <= 1.0:
            raise SchedulerError(f"OneCycleLR pct_start must be in [0, 1]; got {pct_start}.")
        if anneal_strategy not in ("cos", "linear"):
            raise SchedulerError(
                f"OneCycleLR anneal_strategy must be 'cos' or 'linear'; got {anneal_strategy!r}."
            )
        self.total_steps = total_steps
        self.anneal_strategy = anneal_strategy
        self.cycle_momentum = cycle_momentum
        groups = optimizer.param_groups
        max_lrs = _per_group(max_lr, len(groups), "max_lr")
        if last_epoch == -1:
            for group, top in zip(groups, max_lrs):
                group["initial_lr"] = top / div_factor
                group["max_lr"] = top
                group["min_lr"] = group["initial_lr"] / final_div_factor
        self._use_beta1 = "betas" in optimizer.defaults
        if cycle_momentum:
            if "momentum" not in optimizer.defaults and not self._use_beta1:
                raise SchedulerError(
                    "OneCycleLR cycle_momentum needs an optimizer with momentum or betas; "
                    "pass cycle_momentum=False."
                )
            bases = _per_group(base_momentum, len(groups), "base_momentum")
            tops = _per_group(max_momentum, len(groups), "max_momentum")
            if last_epoch == -1:
                for group, low, high in zip(groups, bases, tops):
                    self._set_momentum(group, high)
                    group["max_momentum"] = high
                    group["base_momentum"] = low
        pct_end = float(pct_start * total_steps) - 1
        if three_phase:
            self._phases = [
                (pct_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                (2 * float(pct_start * total_steps) - 2, "max_lr", "initial_lr",
                 "base_momentum", "max_momentum"),
                (total_steps - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"),
            ]
        else:
            self._phases = [
                (pct_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                (total_steps - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"),
            ]
        super().__init__(optimizer, last_epoch)

    def _set_momentum(self, group: dict[str, Any], value: float) -> None:
        if self._use_beta1:
            group["betas"] = (value, *group["betas"][1:])
        else:
            group["momentum"] = value

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step > self.total_steps:
            raise SchedulerError(
                f"Tried to step {step} times. The specified number of total steps is "
                f"{self.total_steps}"
            )
        lrs = []
        for group in self.optimizer.param_groups:
            start_step = 0.0
            for index, (end_step, lr0, lr1, m0, m1) in enumerate(self._phases):
                if step <= end_step or index == len(self._phases) - 1:
                    pct = (step - start_step) / (end_step - start_step)
                    lr = self._anneal(group[lr0], group[lr1], pct)
                    if self.cycle_momentum:
                        self._set_momentum(group, self._anneal(group[m0], group[m1], pct))
                    break
                start_step = end_step
            lrs.append(lr)
        return lrs


def _per_group(value: Any, groups: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise SchedulerError(
                f"OneCycleLR got {len(value)} values of {name} for {groups} parameter groups."
            )
        return list(value)
    return [value] * groups


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
