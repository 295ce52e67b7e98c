"""State dicts of sharded models and their optimizers keyed by parameter name
(torch.distributed.checkpoint.state_dict).

`get_state_dict(model, optimizer)` returns the model's parameters and buffers themselves (shards
stay `ShardedParameter`s) and the optimizer's state keyed by each parameter's name, its arrays
wrapped as shards of the same global tensor when they are shaped like the shard. Every tensor in
both dicts shares memory with the model or the optimizer, so `load` fills them in place; then
`set_state_dict` applies the plain values (step counts, hyper-parameters). A fresh optimizer has
no state to fill: `get_state_dict` first creates it with one step at learning rate 0 on zero
gradients (torch does the same), which leaves the parameters unchanged.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from shoal.collectives.checkpoint.metadata import CheckpointException
from shoal.collectives.fsdp.api import ShardedParameter
from shoal.core import backend
from shoal.core.autograd import no_grad
from shoal.core.tensor import Tensor

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
           "set_state_dict"]


@dataclass(frozen=True)
class StateDictOptions:
    """full_state_dict=True: whole tensors (gathered from the shards: a collective) instead of
    the shards themselves; set_* then takes whole tensors and keeps each rank's part."""

    full_state_dict: bool = False
    cpu_offload: bool = False


def get_model_state_dict(model: Any, *,
                         options: Optional[StateDictOptions] = None) -> "OrderedDict[str, Tensor]":
    """The model's parameters (shards as they are) and persistent buffers, by name."""
    out: "OrderedDict[str, Tensor]" = OrderedDict(model.named_parameters())
    if options is not None and options.full_state_dict:
        out = OrderedDict((k, v.full_tensor() if isinstance(v, ShardedParameter) else
                           Tensor(v.array.copy())) for k, v in out.items())
    persistent = set(model.state_dict())
    for name, buf in model.named_buffers():
        if name in persistent:
            out[name] = buf
    return out


def _names(model: Any) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _as_shard_of(value: Any, param: Any) -> Any:
    """An optimizer state array shaped like `param`'s shard, seen as a shard of the same global
    tensor (sharing memory); anything else as it is."""
    if not isinstance(param, ShardedParameter) or not isinstance(value, Tensor):
        return value
    if tuple(value.shape) != tuple(param.shape):
        return value
    view = ShardedParameter(value.array, requires_grad=False)
    view.global_shape, view.shard_offset = param.global_shape, param.shard_offset
    view.shard_numel, view.group = param.shard_numel, param.group
    return view


def _init_state(optimizer: Any) -> None:
    """Create a fresh optimizer's state without changing a parameter (lr 0, zero gradients)."""
    if optimizer.state:
        return
    lrs, grads = [], []
    for group in optimizer.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = 0.0
        for p in group["params"]:
            grads.append((p, p.grad))
            if p.requires_grad:
                p.grad = Tensor(backend.array_module(p.array).zeros_like(p.array))
    try:
        with no_grad():
            optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p, grad in grads:
            p.grad = grad


def get_optimizer_state_dict(model: Any, optimizers: Any) -> dict:
    """{'state': {param name: {key: value}}, 'param_groups': [{..., 'params': [names]}]}."""
    names = _names(model)
    state: dict[str, dict] = {}
    groups = []
    for optimizer in _listed(optimizers):
        _init_state(optimizer)
        for p, entry in optimizer.state.items():
            if id(p) not in names:
                raise CheckpointException("The optimizer holds a parameter the model does not.")
            state[names[id(p)]] = {k: _as_shard_of(v, p) for k, v in entry.items()}
        for group in optimizer.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [names[id(p)] for p in group["params"]]
            groups.append(packed)
    return {"state": state, "param_groups": groups}


def get_state_dict(model: Any, optimizers: Any) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict), both sharing memory with what they describe."""
    return get_model_state_dict(model), get_optimizer_state_dict(model, optimizers)


def _copy_into(dest: Tensor, src: Any, name: str) -> None:
    if dest is src:
        return
    arr = src.array if isinstance(src, Tensor) else src
    if isinstance(dest, ShardedParameter) and tuple(arr.shape) == tuple(dest.global_shape):
        # A whole tensor into a shard: this rank's run of its elements, padding left as is.
        part = backend.to_device(arr, dest.device).reshape(-1)
        part = part[dest.shard_offset:dest.shard_offset + dest.shard_numel]
        dest.array[:dest.shard_numel] = part
        return
    if tuple(arr.shape) != tuple(dest.array.shape):
        raise CheckpointException(f"{name}: shape {tuple(arr.shape)} does not fit "
                                  f"{tuple(dest.array.shape)}.")
    dest.array[...] = backend.to_device(arr, dest.device)


def set_model_state_dict(model: Any, model_state_dict: dict, *, options: Any = None) -> None:
    """Copy `model_state_dict`'s tensors into the model's (in place; shards into shards)."""
    own = get_model_state_dict(model)
    for name, value in model_state_dict.items():
        if name not in own:
            raise CheckpointException(f"The model has no parameter or buffer {name!r}.")
        _copy_into(own[name], value, name)


def set_optimizer_state_dict(model: Any, optimizers: Any, optim_state_dict: dict, *,
                             options: Any = None) -> None:
    """Apply a name-keyed optimizer state dict: arrays in place, values and groups set."""
    params = {name: p for name, p in model.named_parameters()}
    listed = _listed(optimizers)
    for optimizer in listed:
        _init_state(optimizer)
    saved_groups = iter(optim_state_dict["param_groups"])
    for optimizer in listed:
        for group in optimizer.param_groups:
            saved = next(saved_groups)
            for k, v in saved.items():
                if k != "params":
                    group[k] = copy.deepcopy(v)
        for p, entry in optimizer.state.items():
            name = next((n for n, q in params.items() if q is p), None)
            for key, value in optim_state_dict["state"].get(name, {}).items():
                if isinstance(entry.get(key), Tensor):
                    _copy_into(entry[key], value, f"{name}.{key}")
                else:
                    entry[key] = copy.deepcopy(value)


def set_state_dict(model: Any, optimizers: Any, *, model_state_dict: dict,
                   optim_state_dict: dict, options: Optional[Any] = None) -> None:
    """set_model_state_dict then set_optimizer_state_dict."""
    set_model_state_dict(model, model_state_dict)
    set_optimizer_state_dict(model, optimizers, optim_state_dict)


def _listed(optimizers: Any) -> list:
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
