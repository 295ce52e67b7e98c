"""functional_call: run a module with parameters and buffers given as tensors, as torch.func."""

from __future__ import annotations

from typing import Any

from shoal.core.nn.module import Module
from shoal.core.ops import shape as shape_ops


def _merged(dicts: Any) -> dict:
    if isinstance(dicts, dict):
        return dict(dicts)
    merged: dict = {}
    for d in dicts:
        for k, v in d.items():
            if k in merged:
                raise ValueError(f"{k} appeared in multiple dictionaries; behavior of "
                                 "functional call is ambiguous")
            merged[k] = v
    return merged


def _owner(module: Module, name: str) -> tuple[Module, str]:
    *path, leaf = name.split(".")
    sub = module
    for p in path:
        sub = getattr(sub, p)
    return sub, leaf


def functional_call(module: Module, parameter_and_buffer_dicts: Any, args: Any = None,
                    kwargs: dict | None = None, *, tie_weights: bool = True,
                    strict: bool = False) -> Any:
    """module(*args, **kwargs) with the named parameters/buffers replaced by the given tensors;
    the module is unchanged afterwards (a tensor may be batched or tracked by a transform)."""
    given = _merged(parameter_and_buffer_dicts)
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(dict(module.named_buffers(remove_duplicate=False)))
    if strict:
        missing = sorted(set(own) - set(given))
        unexpected = sorted(set(given) - set(own))
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in reparametrizing for {type(module).__name__}:\n"
                               f"\tUnexpected key(s): {', '.join(map(repr, unexpected))}.\n"
                               f"\tMissing key(s): {', '.join(map(repr, missing))}.")
    if tie_weights:
        by_id = {id(own[k]): v for k, v in given.items() if k in own}
        for k, p in own.items():
            if k not in given and id(p) in by_id:
                given[k] = by_id[id(p)]
    swapped = []
    try:
        for name, value in given.items():
            sub, leaf = _owner(module, name)
            for table in (sub._parameters, sub._buffers):  # noqa: SLF001 - swapped and restored
                if leaf in table:
                    swapped.append((table, leaf, table[leaf]))
                    table[leaf] = value
                    break
            else:
                swapped.append((sub.__dict__, leaf, sub.__dict__.get(leaf, _ABSENT)))
                sub.__dict__[leaf] = value
        call_args = args if isinstance(args, tuple) else (() if args is None else (args,))
        return module(*call_args, **(kwargs or {}))
    finally:
        for table, leaf, old in reversed(swapped):
            if old is _ABSENT:
                del table[leaf]
            else:
                table[leaf] = old


_ABSENT = object()


def stack_module_state(models: Any) -> tuple[dict, dict]:
    """({name: stacked parameters}, {name: stacked buffers}) of same-shaped models, for vmap
    over an ensemble with functional_call (torch.func.stack_module_state)."""
    models = list(models)
    if not models:
        raise RuntimeError("stack_module_state: Expected at least one model, got 0.")
    if len({m.training for m in models}) != 1:
        raise RuntimeError("stack_module_state: Expected all models to have the same "
                           "training/eval mode.")
    kinds = {type(m) for m in models}
    if len(kinds) != 1:
        raise RuntimeError("stack_module_state: Expected all models to be of the same class.")

    def stacked(named: list) -> dict:
        out = {}
        for name, first in named[0]:
            values = [dict(n)[name] for n in named]
            t = shape_ops.stack([v.detach() for v in values])
            out[name] = t.requires_grad_(True) if first.requires_grad else t
        return out

    params = stacked([list(m.named_parameters()) for m in models])
    buffers = stacked([list(m.named_buffers()) for m in models])
    return params, buffers
