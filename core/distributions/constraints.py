"""torch.distributions.constraints: what a parameter or a value must satisfy (checked only
when a distribution validates its arguments)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core.ops.creation import tensor
from shoal.core.tensor import Tensor


def _array(value: Any) -> np.ndarray:
    """The values to check, as numpy (a check never takes part in autograd)."""
    if isinstance(value, Tensor):
        return np.asarray(value.detach().numpy())
    return np.asarray(value)


def _fmt(bound: Any) -> str:
    """A bound as torch prints it in a repr: a one-element tensor as its number."""
    if isinstance(bound, Tensor) and bound.ndim == 0:
        return repr(bound.item())
    return str(bound)


class Constraint:
    """A region of values; `check(value)` is a bool tensor of which elements lie in it."""

    is_discrete = False
    event_dim = 0

    def check(self, value: Any) -> Tensor:
        """Elementwise membership (over the last `event_dim` dims for event constraints)."""
        return tensor(self.check_array(_array(value)))

    def check_array(self, v: np.ndarray) -> np.ndarray:
        """`check` on a numpy array, returning one."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__.lstrip("_") + "()"


class _Dependent(Constraint):
    """A constraint that depends on other parameters (not checked on its own)."""


class _Real(Constraint):
    def check_array(self, v: np.ndarray) -> np.ndarray:
        return v == v  # False for NaNs, as torch's


class _Boolean(Constraint):
    is_discrete = True

    def check_array(self, v: np.ndarray) -> np.ndarray:
        return (v == 0) | (v == 1)


class _GreaterThan(Constraint):
    def __init__(self, lower_bound: Any) -> None:
        self.lower_bound = lower_bound

    def check_array(self, v: np.ndarray) -> np.ndarray:
        return _array(self.lower_bound) < v

    def __repr__(self) -> str:
        return f"GreaterThan(lower_bound={_fmt(self.lower_bound)})"


class _LessThan(Constraint):
    def __init__(self, upper_bound: Any) -> None:
        self.upper_bound = upper_bound

    def check_array(self, v: np.ndarray) -> np.ndarray:
        return v < _array(self.upper_bound)

    def __repr__(self) -> str:
        return f"LessThan(upper_bound={_fmt(self.upper_bound)})"


class _Interval(Constraint):
    def __init__(self, lower_bound: Any, upper_bound: Any) -> None:
        self.lower_bound = lower_bound
        self.upper_bound = upper_bound

    def check_array(self, v: np.ndarray) -> np.ndarray:
        return (_array(self.lower_bound) <= v) & (v <= _array(self.upper_bound))

    def __repr__(self) -> str:
        return (f"{type(self).__name__.lstrip('_')}(lower_bound={_fmt(self.lower_bound)}, "
                f"upper_bound={_fmt(self.upper_bound)})")


class _IntegerInterval(_Interval):
    is_discrete = True

    def check_array(self, v: np.ndarray) -> np.ndarray:
        return (v % 1 == 0) & super().check_array(v)


class _Simplex(Constraint):
    event_dim = 1

    def check_array(self, v: np.ndarray) -> np.ndarray:
        # torch's tolerance on the sum, in the value's own precision
        return np.all(v >= 0, axis=-1) & (np.abs(v.sum(-1) - 1) < 1e-6)


class _IndependentConstraint(Constraint):
    def __init__(self, base: Constraint, reinterpreted_batch_ndims: int) -> None:
        self.base_constraint = base
        self.reinterpreted_batch_ndims = reinterpreted_batch_ndims
        self.event_dim = base.event_dim + reinterpreted_batch_ndims

    def check_array(self, v: np.ndarray) -> np.ndarray:
        ok = self.base_constraint.check_array(v)
        return ok.reshape(ok.shape[:ok.ndim - self.reinterpreted_batch_ndims] + (-1,)).all(-1)

    def __repr__(self) -> str:
        return (f"IndependentConstraint({self.base_constraint!r}, "
                f"{self.reinterpreted_batch_ndims})")


dependent = _Dependent()
real = _Real()
boolean = _Boolean()
positive = _GreaterThan(0.0)
unit_interval = _Interval(0.0, 1.0)
simplex = _Simplex()
real_vector = _IndependentConstraint(real, 1)
greater_than = _GreaterThan
less_than = _LessThan
interval = _Interval
integer_interval = _IntegerInterval
independent = _IndependentConstraint


def is_dependent(constraint: Any) -> bool:
    """Whether `constraint` depends on other parameters (torch's name)."""
    return isinstance(constraint, _Dependent)


__all__ = ["Constraint", "boolean", "dependent", "greater_than", "independent",
           "integer_interval", "interval", "is_dependent", "less_than", "positive", "real",
           "real_vector", "simplex", "unit_interval"]
