"""`Adam` and `AdamW` (decoupled weight decay), with amsgrad and maximize, as torch.optim."""

from __future__ import annotations

from typing import Any

from shoal.core import backend
from shoal.core.kernels import adam_step
from shoal.core.optim.optimizer import Optimizer, OptimizerError, ParamsT
from shoal.core.tensor import Tensor


class Adam(Optimizer):
    """Adam; state per parameter: 'step' (int), 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'."""

    _decoupled = False
    _default_weight_decay = 0.0

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        """`weight_decay` None means the class's default: 0 for Adam, 1e-2 for AdamW."""
        if weight_decay is None:
            weight_decay = self._default_weight_decay
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for key in ("lr", "eps", "weight_decay"):
            if group[key] < 0.0:
                raise OptimizerError(f"{name} {key} must be >= 0; got {group[key]}.")
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise OptimizerError(f"{name} betas must be two numbers in [0, 1); got {betas}.")

    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        kwargs = dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], decoupled=self._decoupled,
            maximize=group["maximize"],
        )
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = self._checked_grad(p)
            data = p.array
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = Tensor(_zeros_like(data))
                state["exp_avg_sq"] = Tensor(_zeros_like(data))
                if amsgrad:
                    state["max_exp_avg_sq"] = Tensor(_zeros_like(data))
            elif amsgrad and "max_exp_avg_sq" not in state:
                # amsgrad switched on later (e.g. by a loaded group): start its maximum at zero.
                state["max_exp_avg_sq"] = Tensor(_zeros_like(data))
            state["step"] += 1
            max_sq = state["max_exp_avg_sq"].array if amsgrad else None
            adam_step(
                data, grad, state["exp_avg"].array, state["exp_avg_sq"].array, max_sq,
                step=state["step"], scratch=self._scratch(data, 2), **kwargs,
            )


class AdamW(Adam):
    """Adam with decoupled weight decay (param *= 1 - lr * weight_decay before the update)."""

    _decoupled = True
    _default_weight_decay = 1e-2


def _zeros_like(data: Any) -> Any:
    return backend.array_module(data).zeros_like(data)
