"""Adagrad, Adadelta, RMSprop and Rprop with torch.optim's arguments, state keys and updates.

`foreach` is accepted and ignored (one loop serves every parameter); `capturable` is accepted
and changes nothing (no CUDA graphs); `differentiable=True` is refused.
"""

from __future__ import annotations

from typing import Any

from shoal.core import backend
from shoal.core.optim._elementwise import (
    ElementwiseOptimizer, check_nonnegative, zeros_state,
)
from shoal.core.optim.optimizer import OptimizerError, ParamsT
from shoal.core.tensor import Tensor


class Adagrad(ElementwiseOptimizer):
    """Adagrad; state per parameter: 'step', 'sum' (of squared gradients)."""

    def __init__(
        self, params: ParamsT, lr: float = 1e-2, lr_decay: float = 0.0,
        weight_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10,
        foreach: bool | None = None, *, maximize: bool = False, differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        check_nonnegative(
            "Adagrad", lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps,
        )
        if fused:
            raise OptimizerError("Adagrad(fused=True) is not supported; leave fused unset.")
        defaults = dict(
            lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, foreach=foreach,
            maximize=maximize, differentiable=differentiable, fused=fused,
        )
        super().__init__(params, defaults)
        # torch fills 'sum' when the optimizer is built, not at the first step.
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = 0
                self._init_state(self.state[p], p.array, group)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        value = group["initial_accumulator_value"]
        state["sum"] = Tensor(backend.array_module(data).full_like(data, value))

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        clr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
        total = state["sum"].array
        total += grad * grad
        std = xp.sqrt(total)
        std += group["eps"]
        data -= clr * (grad / std)


class Adadelta(ElementwiseOptimizer):
    """Adadelta; state per parameter: 'step', 'square_avg', 'acc_delta'."""

    def __init__(
        self, params: ParamsT, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6,
        weight_decay: float = 0.0, foreach: bool | None = None, *, capturable: bool = False,
        maximize: bool = False, differentiable: bool = False,
    ) -> None:
        check_nonnegative("Adadelta", lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= rho <= 1.0:
            raise OptimizerError(f"Invalid rho value: {rho}")
        defaults = dict(
            lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize,
            capturable=capturable, foreach=foreach, differentiable=differentiable,
        )
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        state["square_avg"] = zeros_state(data)
        state["acc_delta"] = zeros_state(data)

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        rho, eps = group["rho"], group["eps"]
        square_avg, acc_delta = state["square_avg"].array, state["acc_delta"].array
        square_avg *= rho
        square_avg += (1 - rho) * (grad * grad)
        delta = xp.sqrt(acc_delta + eps) / xp.sqrt(square_avg + eps) * grad
        acc_delta *= rho
        acc_delta += (1 - rho) * (delta * delta)
        data -= group["lr"] * delta


class RMSprop(ElementwiseOptimizer):
    """RMSprop, plain or centered, with momentum; state: 'step', 'square_avg', and
    'momentum_buffer' (momentum > 0) and 'grad_avg' (centered)."""

    def __init__(
        self, params: ParamsT, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
        weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False,
        capturable: bool = False, foreach: bool | None = None, maximize: bool = False,
        differentiable: bool = False,
    ) -> None:
        check_nonnegative(
            "RMSprop", lr=lr, eps=eps, momentum=momentum, weight_decay=weight_decay, alpha=alpha,
        )
        defaults = dict(
            lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered,
            weight_decay=weight_decay, capturable=capturable, foreach=foreach,
            maximize=maximize, differentiable=differentiable,
        )
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        state["square_avg"] = zeros_state(data)
        if group["momentum"] > 0:
            state["momentum_buffer"] = zeros_state(data)
        if group["centered"]:
            state["grad_avg"] = zeros_state(data)

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        alpha = group["alpha"]
        square_avg = state["square_avg"].array
        square_avg *= alpha
        square_avg += (1 - alpha) * (grad * grad)
        if group["centered"]:
            grad_avg = state["grad_avg"].array
            grad_avg += (1 - alpha) * (grad - grad_avg)  # torch's lerp_
            avg = xp.sqrt(square_avg - grad_avg * grad_avg)
        else:
            avg = xp.sqrt(square_avg)
        avg += group["eps"]
        if group["momentum"] > 0:
            buf = state["momentum_buffer"].array
            buf *= group["momentum"]
            buf += grad / avg
            data -= group["lr"] * buf
        else:
            data -= group["lr"] * (grad / avg)


class Rprop(ElementwiseOptimizer):
    """Resilient backpropagation; state: 'step', 'prev' (last gradient), 'step_size'."""

    def __init__(
        self, params: ParamsT, lr: float = 1e-2, etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50), *, capturable: bool = False,
        foreach: bool | None = None, maximize: bool = False, differentiable: bool = False,
    ) -> None:
        check_nonnegative("Rprop", lr=lr)
        if not 0.0 < etas[0] < 1.0 < etas[1]:
            raise OptimizerError(f"Invalid eta values: {etas[0]}, {etas[1]}")
        defaults = dict(
            lr=lr, etas=tuple(etas), step_sizes=tuple(step_sizes), foreach=foreach,
            maximize=maximize, differentiable=differentiable, capturable=capturable,
        )
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        state["prev"] = zeros_state(data)
        state["step_size"] = Tensor(backend.array_module(data).full_like(data, group["lr"]))

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        etaminus, etaplus = group["etas"]
        low, high = group["step_sizes"]
        prev, step_size = state["prev"].array, state["step_size"].array
        sign = xp.sign(grad * prev)
        factor = xp.where(sign > 0, etaplus, xp.where(sign < 0, etaminus, 1.0))
        step_size *= factor
        xp.clip(step_size, low, high, out=step_size)
        # After a sign change the step is skipped and the gradient forgotten, as torch does.
        grad = xp.where(sign < 0, 0.0, grad).astype(data.dtype, copy=False)
        data -= xp.sign(grad) * step_size
        prev[...] = grad
