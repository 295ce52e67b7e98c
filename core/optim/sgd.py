"""`SGD` with momentum, dampening, nesterov, weight decay and maximize, as torch.optim.SGD."""

from __future__ import annotations

from typing import Any

from shoal.core.kernels import sgd_step
from shoal.core.optim.optimizer import Optimizer, OptimizerError, ParamsT
from shoal.core.tensor import Tensor


class SGD(Optimizer):
    """Stochastic gradient descent; state['momentum_buffer'] per parameter when momentum > 0."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        for key in ("lr", "momentum", "weight_decay"):
            if group[key] < 0.0:
                raise OptimizerError(f"SGD {key} must be >= 0; got {group[key]}.")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise OptimizerError(
                f"SGD nesterov momentum requires momentum > 0 and zero dampening; got "
                f"momentum={group['momentum']} and dampening={group['dampening']}."
            )

    def _step_group(self, group: dict[str, Any]) -> None:
        lr = group["lr"]
        momentum = group["momentum"]
        dampening = group["dampening"]
        nesterov = group["nesterov"]
        weight_decay = group["weight_decay"]
        maximize = group["maximize"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = self._checked_grad(p)
            data = p.array
            buf = None
            first = False
            if momentum != 0.0:
                state = self.state[p]
                buf_tensor = state.get("momentum_buffer")
                if buf_tensor is None:
                    first = True
                    buf_tensor = state["momentum_buffer"] = Tensor(data.copy())
                buf = buf_tensor.array
            sgd_step(
                data, grad, buf, lr=lr, momentum=momentum, dampening=dampening,
                nesterov=nesterov, weight_decay=weight_decay, maximize=maximize, first=first,
                scratch=self._scratch(data, 1),
            )
