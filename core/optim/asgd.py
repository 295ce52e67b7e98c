"""Averaged SGD (torch.optim.ASGD): SGD whose step size decays as lr / (1 + lambd lr t)^alpha,
with a running average `ax` of the iterates that starts at step t0. State keys are torch's:
'step', 'eta', 'mu', 'ax'."""

from __future__ import annotations

from typing import Any

from shoal.core.optim._elementwise import ElementwiseOptimizer, check_nonnegative, zeros_state
from shoal.core.optim.optimizer import OptimizerError, ParamsT

__all__ = ["ASGD"]


class ASGD(ElementwiseOptimizer):
    """torch.optim.ASGD; weight_decay is the coupled (L2) form, as torch's."""

    def __init__(self, params: ParamsT, lr: float = 1e-2, lambd: float = 1e-4,
                 alpha: float = 0.75, t0: float = 1e6, weight_decay: float = 0,
                 foreach: bool | None = None, maximize: bool = False,
                 differentiable: bool = False, capturable: bool = False) -> None:
        check_nonnegative("ASGD", lr=lr, weight_decay=weight_decay)
        if capturable:
            raise OptimizerError("ASGD(capturable=True) is for CUDA graphs, which shoal lacks.")
        defaults = dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay,
                        foreach=foreach, maximize=maximize, differentiable=differentiable,
                        capturable=capturable)
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        state["eta"] = float(group["lr"])
        state["mu"] = 1.0
        state["ax"] = zeros_state(data)

    def _update(self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any],
                xp: Any) -> None:
        eta, step = state["eta"], state["step"]
        data *= 1 - group["lambd"] * eta  # the decay toward zero, then the gradient step
        data -= eta * grad
        ax = state["ax"].array
        if state["mu"] != 1:
            ax += (data - ax) * state["mu"]
        else:
            ax[...] = data
        lr = group["lr"]
        state["eta"] = lr / ((1 + group["lambd"] * lr * step) ** group["alpha"])
        state["mu"] = 1 / max(1, step - group["t0"])
