"""Schedules that cycle: OneCycleLR and CosineAnnealingWarmRestarts, as torch's."""

from __future__ import annotations

import math
from typing import Any, Sequence

from shoal.core.optim.lr_scheduler.base import LRScheduler, SchedulerError
from shoal.core.optim.optimizer import Optimizer


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




class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing from the base rate to eta_min over T_i epochs, restarting each time;
    the period starts at T_0 and is multiplied by T_mult at every restart (SGDR)."""

    def __init__(
        self, optimizer: Optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(T_0, int) or T_0 <= 0:
            raise SchedulerError(f"Expected positive integer T_0, but got {T_0}")
        if not isinstance(T_mult, int) or T_mult < 1:
            raise SchedulerError(f"Expected integer T_mult >= 1, but got {T_mult}")
        if not isinstance(eta_min, (float, int)):
            raise SchedulerError(
                f"Expected float or int eta_min, but got {eta_min} of type {type(eta_min)}"
            )
        self.T_0 = T_0
        self.T_i = T_0
        self.T_mult = T_mult
        self.eta_min = eta_min
        self.T_cur = last_epoch
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        cosine = (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2
        return [self.eta_min + (base - self.eta_min) * cosine for base in self.base_lrs]

    def step(self, epoch: float | None = None) -> None:
        """Advance one epoch, or jump to `epoch` (fractions allowed, as torch's)."""
        if epoch is None and self.last_epoch < 0:
            epoch = 0
        if epoch is None:
            epoch = self.last_epoch + 1
            self.T_cur = self.T_cur + 1
            if self.T_cur >= self.T_i:
                self.T_cur = self.T_cur % self.T_i
                self.T_i = self.T_i * self.T_mult
        elif epoch < 0:
            raise SchedulerError(f"Expected non-negative epoch, but got {epoch}")
        elif epoch >= self.T_0:
            if self.T_mult == 1:
                self.T_cur = epoch % self.T_0
            else:
                n = int(math.log((epoch / self.T_0 * (self.T_mult - 1) + 1), self.T_mult))
                self.T_cur = epoch - self.T_0 * (self.T_mult**n - 1) / (self.T_mult - 1)
                self.T_i = self.T_0 * self.T_mult**n
        else:
            self.T_i = self.T_0
            self.T_cur = epoch
        self.last_epoch = math.floor(epoch)
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = self._current_lrs()
