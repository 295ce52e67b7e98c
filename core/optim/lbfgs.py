"""L-BFGS with torch's semantics: one parameter group, a closure evaluated several times per
`step`, the two-loop recursion over the last `history_size` curvature pairs, and either a
fixed step (`lr`) or the strong Wolfe line search. State keys are torch's ('d', 't',
'old_dirs', 'old_stps', 'ro', 'H_diag', 'prev_flat_grad', 'prev_loss', 'n_iter',
'func_evals'), kept on the first parameter as torch keeps them."""

from __future__ import annotations

from typing import Any, Callable

from shoal.core import backend
from shoal.core.grad_mode import enable_grad
from shoal.core.optim.line_search import strong_wolfe
from shoal.core.optim.optimizer import (
    Optimizer, OptimizerError, ParamsT, _hyperparameters_as_numbers,
)

__all__ = ["LBFGS"]


class LBFGS(Optimizer):
    """torch.optim.LBFGS: `step(closure)` runs up to max_iter iterations."""

    def __init__(self, params: ParamsT, lr: float = 1, max_iter: int = 20,
                 max_eval: int | None = None, tolerance_grad: float = 1e-7,
                 tolerance_change: float = 1e-9, history_size: int = 100,
                 line_search_fn: str | None = None) -> None:
        if line_search_fn not in (None, "strong_wolfe"):
            raise ValueError("only 'strong_wolfe' is supported")
        defaults = dict(lr=lr, max_iter=max_iter,
                        max_eval=max_iter * 5 // 4 if max_eval is None else max_eval,
                        tolerance_grad=tolerance_grad, tolerance_change=tolerance_change,
                        history_size=history_size, line_search_fn=line_search_fn)
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")
        self._params = self.param_groups[0]["params"]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Minimise along L-BFGS directions; returns the closure's first loss."""
        if closure is None:
            raise OptimizerError("LBFGS requires a closure that re-evaluates the loss")
        group = _hyperparameters_as_numbers(self.param_groups[0])
        state = self.state[self._params[0]]
        state.setdefault("func_evals", 0)
        state.setdefault("n_iter", 0)
        with enable_grad():
            orig_loss = closure()
        loss, flat_grad = float(orig_loss), _flat_grad(self._params)
        state["func_evals"] += 1
        if float(abs(flat_grad).max()) <= group["tolerance_grad"]:
            return orig_loss
        run = _Run(self._params, group, state, closure)
        run.iterate(loss, flat_grad)
        return orig_loss


def _flat_grad(params: list) -> Any:
    """Every parameter's gradient in one flat array (zeros where a parameter has none)."""
    xp = backend.array_module(params[0].array)  # numpy or cupy, as the parameters
    return xp.concatenate([
        xp.zeros(p.array.size, p.array.dtype) if p.grad is None
        else p.grad.array.reshape(-1) for p in params])


def _add_step(params: list, t: float, d: Any) -> None:
    """params += t * d, d flat over the parameters in order, in place."""
    offset = 0
    for p in params:
        n = p.array.size
        p.array += (t * d[offset:offset + n]).reshape(p.array.shape).astype(p.array.dtype)
        offset += n


def _snapshot(params: list) -> list:
    return [p.array.copy() for p in params]


def _restore(params: list, saved: list) -> None:
    for p, data in zip(params, saved):
        p.array[...] = data


class _Run:
    """One `step`'s iterations, carrying torch's state between steps."""

    def __init__(self, params: list, group: dict, state: dict, closure: Callable) -> None:
        self.params, self.group, self.state, self.closure = params, group, state, closure
        self.d, self.t = state.get("d"), state.get("t")
        self.old_dirs, self.old_stps = state.get("old_dirs"), state.get("old_stps")
        self.ro, self.h_diag = state.get("ro"), state.get("H_diag")
        self.prev_flat_grad, self.prev_loss = state.get("prev_flat_grad"), state.get("prev_loss")

    def _direction(self, flat_grad: Any) -> None:
        if self.state["n_iter"] == 1:
            self.d, self.old_dirs, self.old_stps, self.ro, self.h_diag = -flat_grad, [], [], [], 1
            return
        y = flat_grad - self.prev_flat_grad
        s = self.d * self.t
        ys = float(y @ s)
        if ys > 1e-10:  # keep the pair only where the curvature condition holds
            if len(self.old_dirs) == self.group["history_size"]:
                self.old_dirs.pop(0)
                self.old_stps.pop(0)
                self.ro.pop(0)
            self.old_dirs.append(y)
            self.old_stps.append(s)
            self.ro.append(1.0 / ys)
            self.h_diag = ys / float(y @ y)
        al = [0.0] * len(self.old_dirs)
        q = -flat_grad
        for i in range(len(self.old_dirs) - 1, -1, -1):
            al[i] = float(self.old_stps[i] @ q) * self.ro[i]
            q = q - al[i] * self.old_dirs[i]
        r = q * self.h_diag
        for i in range(len(self.old_dirs)):
            be_i = float(self.old_dirs[i] @ r) * self.ro[i]
            r = r + (al[i] - be_i) * self.old_stps[i]
        self.d = r

    def _evaluate_at(self, saved: list) -> Callable[[float], tuple[float, Any]]:
        def evaluate(t: float) -> tuple[float, Any]:
            _add_step(self.params, t, self.d)
            with enable_grad():
                loss = float(self.closure())
            grad = _flat_grad(self.params)
            _restore(self.params, saved)
            return loss, grad
        return evaluate

    def iterate(self, loss: float, flat_grad: Any) -> None:
        group, state = self.group, self.state
        n_iter, current_evals = 0, 1
        while n_iter < group["max_iter"]:
            n_iter += 1
            state["n_iter"] += 1
            self._direction(flat_grad)
            self.prev_flat_grad, self.prev_loss = flat_grad.copy(), loss
            if state["n_iter"] == 1:
                self.t = min(1.0, 1.0 / float(abs(flat_grad).sum())) * group["lr"]
            else:
                self.t = group["lr"]
            gtd = float(flat_grad @ self.d)
            if gtd > -group["tolerance_change"]:
                break
            if group["line_search_fn"] is not None:
                # the search may spend only what is left of this step's evaluation budget
                loss, flat_grad, self.t, evals = strong_wolfe(
                    self._evaluate_at(_snapshot(self.params)), self.t, self.d, loss, flat_grad, gtd,
                    max_ls=group["max_eval"] - current_evals)
                _add_step(self.params, self.t, self.d)
            else:
                _add_step(self.params, self.t, self.d)
                evals = 0
                if n_iter != group["max_iter"]:
                    with enable_grad():
                        loss = float(self.closure())
                    flat_grad, evals = _flat_grad(self.params), 1
            opt_cond = float(abs(flat_grad).max()) <= group["tolerance_grad"]
            current_evals += evals
            state["func_evals"] += evals
            if (n_iter == group["max_iter"] or current_evals >= group["max_eval"] or opt_cond
                    or float(abs(self.d * self.t).max()) <= group["tolerance_change"]
                    or abs(loss - self.prev_loss) < group["tolerance_change"]):
                break
        state.update(d=self.d, t=self.t, old_dirs=self.old_dirs, old_stps=self.old_stps,
                     ro=self.ro, H_diag=self.h_diag, prev_flat_grad=self.prev_flat_grad,
                     prev_loss=self.prev_loss)
