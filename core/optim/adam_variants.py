"""Adamax, NAdam and RAdam with torch.optim's arguments, state keys and updates.

`foreach` is accepted and ignored (one loop serves every parameter); `capturable` is accepted
and changes nothing (no CUDA graphs); `differentiable=True` is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.optim._elementwise import (
    ElementwiseOptimizer, check_betas, check_nonnegative, zeros_state,
)
from shoal.core.optim.optimizer import ParamsT


class _AdamLike(ElementwiseOptimizer):
    """Shared arguments and state ('step', 'exp_avg', 'exp_avg_sq') of NAdam and RAdam."""

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        state["exp_avg"] = zeros_state(data)
        state["exp_avg_sq"] = zeros_state(data)

    def _moments(self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any]):
        """Apply weight decay (decoupled: to the parameter; else: to the gradient), then
        update and return both moving averages."""
        beta1, beta2 = group["betas"]
        weight_decay = group["weight_decay"]
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                data *= 1 - group["lr"] * weight_decay
            else:
                grad = grad + weight_decay * data
        exp_avg, exp_avg_sq = state["exp_avg"].array, state["exp_avg_sq"].array
        exp_avg += (1 - beta1) * (grad - exp_avg)  # torch's lerp_
        exp_avg_sq *= beta2
        exp_avg_sq += (1 - beta2) * (grad * grad)
        return grad, exp_avg, exp_avg_sq


class Adamax(ElementwiseOptimizer):
    """Adam over the infinity norm; state per parameter: 'step', 'exp_avg', 'exp_inf'."""

    def __init__(
        self, params: ParamsT, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0, foreach: bool | None = None, *,
        maximize: bool = False, differentiable: bool = False, capturable: bool = False,
    ) -> None:
        check_nonnegative("Adamax", lr=lr, eps=eps, weight_decay=weight_decay)
        check_betas(betas)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=foreach,
            maximize=maximize, differentiable=differentiable, capturable=capturable,
        )
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        state["exp_avg"] = zeros_state(data)
        state["exp_inf"] = zeros_state(data)

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_inf = state["exp_avg"].array, state["exp_inf"].array
        exp_avg += (1 - beta1) * (grad - exp_avg)  # torch's lerp_
        exp_inf *= beta2
        xp.maximum(exp_inf, xp.abs(grad) + group["eps"], out=exp_inf)
        clr = group["lr"] / (1 - beta1 ** state["step"])
        data -= clr * (exp_avg / exp_inf)


class NAdam(_AdamLike):
    """Adam with Nesterov momentum; state adds 'mu_product' (the running product of mu)."""

    _coupled_weight_decay = False  # _moments applies both forms

    def __init__(
        self, params: ParamsT, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0, momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False, *, foreach: bool | None = None,
        maximize: bool = False, capturable: bool = False, differentiable: bool = False,
    ) -> None:
        check_nonnegative(
            "NAdam", lr=lr, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
        )
        check_betas(betas)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable,
        )
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        state["mu_product"] = 1.0
        super()._init_state(state, data, group)

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        beta1, beta2 = group["betas"]
        step, lr, decay = state["step"], group["lr"], group["momentum_decay"]
        grad, exp_avg, exp_avg_sq = self._moments(data, grad, state, group)
        mu = beta1 * (1.0 - 0.5 * 0.96 ** (step * decay))
        mu_next = beta1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * decay))
        # torch keeps mu_product in a float32 scalar tensor (its default scalar dtype), so the
        # product is rounded to float32 each step; doing the same keeps the updates equal.
        mu_product = float(np.float32(state["mu_product"]) * np.float32(mu))
        state["mu_product"] = mu_product
        denom = xp.sqrt(exp_avg_sq / (1 - beta2**step))
        denom += group["eps"]
        data += (-lr * (1.0 - mu) / (1.0 - mu_product)) * (grad / denom)
        data += (-lr * mu_next / (1.0 - mu_product * mu_next)) * (exp_avg / denom)


class RAdam(_AdamLike):
    """Rectified Adam: plain momentum SGD until the variance estimate is tractable (rho > 5)."""

    _coupled_weight_decay = False  # _moments applies both forms

    def __init__(
        self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0, decoupled_weight_decay: bool = False, *,
        foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        check_nonnegative("RAdam", lr=lr, eps=eps, weight_decay=weight_decay)
        check_betas(betas)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable,
        )
        super().__init__(params, defaults)

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        beta1, beta2 = group["betas"]
        step, lr = state["step"], group["lr"]
        grad, exp_avg, exp_avg_sq = self._moments(data, grad, state, group)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        corrected = exp_avg / bias_correction1
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        if rho_t > 5.0:
            # ** 0.5 rather than math.sqrt: torch's formula, to the last bit.
            rect = (
                (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
            ) ** 0.5
            adaptive = bias_correction2**0.5 / (xp.sqrt(exp_avg_sq) + group["eps"])
            data -= corrected * lr * adaptive * rect
        else:
            data -= corrected * lr
