"""`Optimizer`: parameter groups, per-parameter state, zero_grad and state_dict, as torch.optim.

Subclasses implement `_step_group(group)`; updates run on the raw arrays in `.array` through the
fused kernels of core.kernels (CUDA for cupy arrays, their numpy references on the CPU).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable, Iterable

import numpy as np

from shoal.core import autograd
from shoal.core import backend
from shoal.core.errors import ShapeError, ShoalError
from shoal.core.tensor import Tensor


class OptimizerError(ShoalError, ValueError):
    """Bad optimizer arguments, parameter groups, or a state_dict that does not fit."""


class _Required:
    """Marks a hyper-parameter with no default that each group must then give."""

    def __repr__(self) -> str:
        return "<required parameter>"


required = _Required()

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class Optimizer:
    """Base of shoal's optimizers: param_groups (dicts) and state keyed by parameter."""

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        # Scratch arrays for the numpy kernels, one flat array per dtype, grown on demand and
        # shared by all parameters: the CPU step then allocates nothing once warm.
        self._workspaces: dict[Any, np.ndarray] = {}
        if isinstance(params, Tensor):
            raise OptimizerError(
                f"{type(self).__name__} expects an iterable of Tensors or of dicts, but got a "
                "single Tensor; wrap it in a list."
            )
        groups = list(params)
        if not groups:
            raise OptimizerError(f"{type(self).__name__} got an empty parameter list.")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for index, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {index}")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        return "\n".join(lines) + "\n)"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_workspaces"] = {}
        return state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters with its own hyper-parameters (defaults fill the rest)."""
        if not isinstance(param_group, dict):
            raise OptimizerError(
                f"add_param_group expects a dict, got {type(param_group).__name__}."
            )
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)):
            raise OptimizerError(
                "Optimizer parameters must be given in an ordered collection, not a set: the "
                "order decides the indices in state_dict."
            )
        elif params is None:
            raise OptimizerError("A parameter group needs a 'params' entry.")
        params = list(params)
        for index, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise OptimizerError(
                    f"{type(self).__name__} can only optimize Tensors, but parameter {index} of "
                    f"the group is a {type(p).__name__}."
                )
            if not p.is_leaf:
                raise OptimizerError(
                    f"{type(self).__name__} can't optimize a non-leaf Tensor (parameter "
                    f"{index} of shape {tuple(p.shape)} was produced by an op)."
                )
        if len({id(p) for p in params}) != len(params):
            raise OptimizerError("A parameter group contains the same parameter twice.")
        group["params"] = params
        for key, default in self.defaults.items():
            if default is required and key not in group:
                raise OptimizerError(
                    f"Parameter group didn't specify a value of required optimization "
                    f"parameter {key!r}."
                )
            group.setdefault(key, default)
        self._validate_group(group)
        existing = {id(p) for g in self.param_groups for p in g["params"]}
        if existing & {id(p) for p in params}:
            raise OptimizerError("Some parameters appear in more than one parameter group.")
        self.param_groups.append(group)

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check a group's hyper-parameters; subclasses raise OptimizerError on bad values."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's gradient: to None (default) or to zeros in place."""
        for group in self.param_groups:
            autograd.zero_grads(group["params"], set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; returns closure() when given."""
        loss = None
        if closure is not None:
            loss = closure()
        for group in self.param_groups:
            self._step_group(_hyperparameters_as_numbers(group))
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _scratch(self, data: Any, factor: int) -> Any:
        """A flat scratch array of data's dtype with room for `factor` * data.size elements."""
        if type(data) is not np.ndarray:
            return None  # the CUDA kernels are fused and need none
        need = factor * data.size
        work = self._workspaces.get(data.dtype)
        if work is None or work.size < need:
            work = np.empty(need, dtype=data.dtype)
            self._workspaces[data.dtype] = work
        return work

    @staticmethod
    def _checked_grad(p: Tensor) -> Any:
        grad = p.grad.array
        if grad.shape != p.array.shape:
            raise ShapeError(
                f"Optimizer step: parameter of shape {tuple(p.array.shape)} has a gradient of "
                f"shape {tuple(grad.shape)}."
            )
        return grad

    # -- state_dict ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{'state': {index: {...}}, 'param_groups': [{..., 'params': [indices]}]}, as torch.

        The state's tensors are the optimizer's own (not copies), as in torch: serialize or copy
        the result before stepping again if it must stay a snapshot.
        """
        index_of: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index_of.setdefault(id(p), len(index_of)) for p in group["params"]]
            groups.append(packed)
        state = {index_of[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index_of}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyper-parameters and state; validates everything before changing anything."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict)
            raise OptimizerError(
                f"An optimizer state_dict has exactly the keys 'state' and 'param_groups'; "
                f"got {keys}."
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise OptimizerError(
                f"Loaded state_dict has {len(saved_groups)} parameter groups but "
                f"{type(self).__name__} has {len(self.param_groups)}."
            )
        params: dict[int, Tensor] = {}
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise OptimizerError(
                    f"Loaded state_dict's parameter group {gi} has {len(saved['params'])} "
                    f"parameters but the optimizer's group {gi} has {len(group['params'])}."
                )
            for index, p in zip(saved["params"], group["params"]):
                params[index] = p
        new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for index, entry in state_dict["state"].items():
            if index not in params:
                raise OptimizerError(
                    f"Loaded state_dict has state for parameter index {index}, which no "
                    f"parameter group lists (known indices: 0..{len(params) - 1})."
                )
            p = params[index]
            new_state[p] = {k: self._load_value(p, index, k, v) for k, v in entry.items()}
        # Everything fitted: only now touch the optimizer.
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = copy.deepcopy(value)
        self.state = new_state

    @staticmethod
    def _load_value(p: Tensor, index: int, key: str, value: Any) -> Any:
        """A deep copy of one saved state value, on p's device and in p's dtype if an array."""
        if isinstance(value, Tensor):
            data = value.array
        elif isinstance(value, np.ndarray) or type(value).__module__.startswith("cupy"):
            data = value
        else:
            return copy.deepcopy(value)
        if tuple(data.shape) != tuple(p.shape):
            raise OptimizerError(
                f"Loaded state_dict's {key!r} for parameter {index} has shape "
                f"{tuple(data.shape)} but the parameter has shape {tuple(p.shape)}."
            )
        data = backend.to_device(data, p.device)
        return Tensor(data.astype(p.array.dtype, copy=True))


def _hyperparameters_as_numbers(group: dict[str, Any]) -> dict[str, Any]:
    """The group with one-element tensor hyperparameters (torch accepts `lr=torch.tensor(0.01)`)
    read as numbers for this step. The updates run on raw arrays, where a tensor would not
    combine in place: `data -= lr * step` with a tensor lr rebinds `data` and updates nothing."""
    def number(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.item()
        if isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value):
            return tuple(number(v) for v in value)
        return value

    if not any(isinstance(v, Tensor) or (isinstance(v, tuple) and number(v) is not v)
               for k, v in group.items() if k != "params"):
        return group
    return {k: v if k == "params" else number(v) for k, v in group.items()}
