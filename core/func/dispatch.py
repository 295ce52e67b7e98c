"""How ops reach their batching rules: wrappers swapped in while a vmap runs.

core's ops have no central dispatch (each op is a plain function, bound to Tensor as a method
and re-exported by name in several modules; the profiler meets the same fact, see
core/profiler/instrument.py). So vmap, while it runs, swaps every module-level reference a
shoal (or user) module holds to an op function for a wrapper that sends calls with a
BatchedTensor argument to the op's rule and everything else to the op unchanged; it swaps them
back when the outermost vmap returns. BatchedTensor's methods and operators are such wrappers
permanently (only batched tensors reach them). Code outside vmap runs the original functions.

A rule is `rule(call, level, args, kwargs)`: `call` is the op's wrapper (so calls on a value
that is itself batched at an outer level dispatch again) and `level` is the innermost level
among the arguments.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from shoal.core.func.batched import BatchedTensor
from shoal.core.tensor import Tensor

_RULES: dict[Callable, Callable] = {}
_WRAPPERS: dict[Callable, Callable] = {}
_lock = threading.Lock()
_users = 0
_restore: list[tuple[Any, str, Any]] = []
_scan_cache: tuple[int, int, list] = (-1, -1, [])

# Tensor's operators are closures bound in core/ops/bind.py, so BatchedTensor's are made here
# from the op names they stand for (reflected ones swap their operands).
OPERATORS = {
    "__add__": ("add", False), "__radd__": ("add", True), "__sub__": ("sub", False),
    "__rsub__": ("sub", True), "__mul__": ("mul", False), "__rmul__": ("mul", True),
    "__truediv__": ("div", False), "__rtruediv__": ("div", True), "__pow__": ("pow", False),
    "__rpow__": ("pow", True), "__matmul__": ("matmul", False), "__rmatmul__": ("matmul", True),
    "__eq__": ("eq", False), "__ne__": ("ne", False), "__lt__": ("lt", False),
    "__le__": ("le", False), "__gt__": ("gt", False), "__ge__": ("ge", False),
}


def register(fns: Any, rule: Callable) -> None:
    """Give each op function in `fns` the batching rule `rule`."""
    for fn in fns if isinstance(fns, (list, tuple)) else (fns,):
        _RULES[fn] = rule
        wrapper_for(fn)


def wrapper_for(fn: Callable) -> Callable:
    """The dispatching wrapper of op function `fn` (made once)."""
    w = _WRAPPERS.get(fn)
    if w is None and _WRAPPERS.get(getattr(fn, "__wrapped__", None)) is fn:
        return fn  # already a wrapper: a module attribute read while vmap is installed
    if w is None:
        w = _WRAPPERS[fn] = _make_wrapper(fn)
    return w


def as_dispatching(fn: Any) -> Any:
    """fn's wrapper when fn is an op (vmap(core.sin) must dispatch too), else fn."""
    try:
        return _WRAPPERS.get(fn, fn)
    except TypeError:  # an unhashable callable
        return fn


def innermost_level(args: tuple, kwargs: dict) -> int | None:
    """The highest vmap level among the arguments (one level into lists), or None."""
    best = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, BatchedTensor):
            lvl = a._level  # noqa: SLF001 - dispatch reads the wrapper's level
            best = lvl if best is None or lvl > best else best
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, BatchedTensor):
                    lvl = b._level  # noqa: SLF001
                    best = lvl if best is None or lvl > best else best
    return best


def _make_wrapper(fn: Callable) -> Callable:
    name = getattr(fn, "__name__", repr(fn))

    def batched_call(*args: Any, **kwargs: Any) -> Any:
        level = innermost_level(args, kwargs)
        if level is None:
            special = _UNBATCHED_HOOKS.get(fn)
            return fn(*args, **kwargs) if special is None else special(fn, args, kwargs)
        rule = _RULES.get(fn)
        if rule is None:
            raise NotImplementedError(
                f"vmap: there is no batching rule for core op '{name}' yet, so it cannot take "
                "a batched tensor; compute it outside vmap (core/func/rules.py lists the ops "
                "with rules)."
            )
        return rule(batched_call, level, args, kwargs)

    batched_call.__name__ = name
    batched_call.__qualname__ = getattr(fn, "__qualname__", name)
    batched_call.__module__ = getattr(fn, "__module__", None) or __name__
    batched_call.__doc__ = fn.__doc__
    batched_call.__wrapped__ = fn  # type: ignore[attr-defined]
    return batched_call


# Ops that must act under vmap even with no batched argument (random numbers: torch's
# `randomness=`); `hook(fn, args, kwargs)`.
_UNBATCHED_HOOKS: dict[Callable, Callable] = {}


def register_unbatched_hook(fns: Any, hook: Callable) -> None:
    """Run hook(fn, args, kwargs) for calls of fns without a batched argument under vmap."""
    for fn in fns:
        _UNBATCHED_HOOKS[fn] = hook
        wrapper_for(fn)


def wrap_op_modules(modules: list) -> None:
    """Make a wrapper (with no rule yet: a clear error) for every public op of `modules`."""
    for mod in modules:
        for attr, fn in list(vars(mod).items()):
            if (not attr.startswith("_") and callable(fn) and not isinstance(fn, type)
                    and getattr(fn, "__module__", None) == mod.__name__):
                wrapper_for(fn)


def bind_batched_methods() -> None:
    """BatchedTensor's methods, properties and operators: the wrappers of Tensor's."""
    for attr, value in list(vars(Tensor).items()):
        if attr in OPERATORS or attr in vars(BatchedTensor):
            continue
        if isinstance(value, property) and value.fget in _WRAPPERS:
            setattr(BatchedTensor, attr, property(_WRAPPERS[value.fget], doc=value.__doc__))
        elif callable(value) and not isinstance(value, type) and value in _WRAPPERS:
            setattr(BatchedTensor, attr, _WRAPPERS[value])
    by_name = {getattr(fn, "__name__", ""): fn for fn in _WRAPPERS}
    for attr, (name, reflected) in OPERATORS.items():
        fn = _WRAPPERS[by_name[name]]
        setattr(BatchedTensor, attr, _swap(fn) if reflected else fn)
    BatchedTensor.__hash__ = object.__hash__


def _swap(fn: Callable) -> Callable:
    def reflected(self: Any, other: Any) -> Any:
        return fn(other, self)

    return reflected


_INSTALLED = tuple(sorted({p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}))


def _scans(mod_name: str, mod: Any) -> bool:
    if mod_name.startswith(("shoal.core.func", "shoal.core.profiler")):
        return False
    if mod_name.startswith("shoal.") or mod_name == "__main__":
        return True
    path = getattr(mod, "__file__", None)
    return bool(path) and not path.startswith(_INSTALLED)


def _references() -> list[tuple[Any, str, Any, Callable]]:
    """(module, name, value, op) for every module-level reference to a wrapped op; rescanned only when
    modules were imported or ops registered since the last scan."""
    global _scan_cache
    key = (len(sys.modules), len(_WRAPPERS))
    if _scan_cache[:2] != key:
        refs = []
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not _scans(mod_name, mod):
                continue
            for attr, value in list(vars(mod).items()):
                try:
                    op = value if value in _WRAPPERS else getattr(value, "__wrapped__", None)
                    if op is not None and op in _WRAPPERS:
                        # a profiler's timing wrapper stands for its op while vmap runs
                        refs.append((mod, attr, value, op))
                except (TypeError, ValueError, AttributeError, RuntimeError):
                    # an unhashable attribute, or one whose lookup raises: not an op
                    continue
        _scan_cache = (*key, refs)
    return _scan_cache[2]


def install() -> None:
    """Swap op references for the dispatching wrappers (counted: nested vmaps share)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for mod, attr, value, op in _references():
            if vars(mod).get(attr) is value:
                _restore.append((mod, attr, value))
                setattr(mod, attr, _WRAPPERS[op])


def uninstall() -> None:
    """Put the original references back when the last vmap returns."""
    global _users
    with _lock:
        _users -= 1
        if _users > 0:
            return
        while _restore:
            mod, attr, value = _restore.pop()
            setattr(mod, attr, value)
