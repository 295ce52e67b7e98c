"""The shared loop of the per-element optimizers (Adagrad, RMSprop, NAdam, ...).

Each subclass gives `_init_state` (its state's keys, as torch names them) and `_update` (one
parameter's step on raw arrays, numpy or cupy: only array methods and `xp` functions, so one
code path serves both). The loop handles what every one of them shares: skipping parameters
without a gradient, maximize, the step count, and coupled (L2) weight decay.
"""

from __future__ import annotations

from typing import Any

from shoal.core import backend
from shoal.core.optim.optimizer import Optimizer, OptimizerError, ParamsT
from shoal.core.tensor import Tensor


class ElementwiseOptimizer(Optimizer):
    """Base of the optimizers whose update is elementwise per parameter."""

    # True where weight_decay is added to the gradient by the loop (torch's L2 form); the
    # NAdam/RAdam decoupled form is applied by the subclass itself.
    _coupled_weight_decay = True

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        if defaults.get("differentiable"):
            raise OptimizerError(
                f"{type(self).__name__}(differentiable=True) is not supported: shoal's "
                "optimizer steps update the arrays in place and record no graph."
            )
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], data: Any, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(
        self, data: Any, grad: Any, state: dict[str, Any], group: dict[str, Any], xp: Any
    ) -> None:
        raise NotImplementedError

    def _step_group(self, group: dict[str, Any]) -> None:
        maximize = group.get("maximize", False)
        weight_decay = group.get("weight_decay", 0.0) if self._coupled_weight_decay else 0.0
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = self._checked_grad(p)
            data = p.array
            xp = backend.array_module(data)
            state = self.state[p]
            if not state:
                state["step"] = 0
                self._init_state(state, data, group)
            state["step"] += 1
            if maximize:
                grad = -grad
            if weight_decay != 0:
                grad = grad + weight_decay * data  # a new array: p.grad stays as it was
            self._update(data, grad, state, group, xp)


def zeros_state(data: Any) -> Tensor:
    """A zero-filled state tensor shaped and typed as the parameter."""
    return Tensor(backend.array_module(data).zeros_like(data))


def check_nonnegative(name: str, **values: float) -> None:
    """torch's 'Invalid <what>: value' ValueError for each hyper-parameter below zero."""
    labels = {
        "lr": "learning rate", "eps": "epsilon value", "weight_decay": "weight_decay value",
        "lr_decay": "lr_decay value", "momentum": "momentum value", "alpha": "alpha value",
        "momentum_decay": "momentum_decay value",
        "initial_accumulator_value": "initial_accumulator_value value",
    }
    for key, value in values.items():
        if not 0.0 <= value:
            raise OptimizerError(f"Invalid {labels[key]}: {value} ({name}).")


def check_betas(betas: tuple[float, float]) -> None:
    """Both betas in [0, 1), with torch's message."""
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise OptimizerError(f"Invalid beta parameter at index {index}: {beta}")
