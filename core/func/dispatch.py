"""How ops reach their batching rules while a vmap runs: each op's code is swapped for a
trampoline into its dispatching wrapper.

core's ops have no central dispatch (each op is a plain function, bound to Tensor as a method
and re-exported by name in several modules). So while a vmap runs, every registered op function
gets a trampoline as its `__code__`: a call, however the caller holds the function (a module
attribute, a method, a local variable taken before vmap started), goes to the op's wrapper,
which sends calls with a BatchedTensor argument to the op's rule and everything else to a copy
of the op that runs its own code. The outermost vmap to return puts every op's code back, so
code outside vmap runs the ops untouched.

A rule is `rule(call, level, args, kwargs)`: `call` is the op's wrapper (so calls on a value
that is itself batched at an outer level dispatch again) and `level` is the innermost level
among the arguments.
"""

from __future__ import annotations

import threading
import types
import warnings
from typing import Any, Callable

from shoal.core.func.batched import BatchedTensor

_RULES: dict[Callable, Callable] = {}
_WRAPPERS: dict[Callable, Callable] = {}
_lock = threading.Lock()
_users = 0
_OWN_CODE: dict[Callable, types.CodeType] = {}  # op -> its code, put back on uninstall
_TRAMPOLINES: dict[Callable, types.CodeType] = {}  # op -> code calling the op's wrapper


def register(fns: Any, rule: Callable) -> None:
    """Give each op function in `fns` the batching rule `rule`."""
    for fn in fns if isinstance(fns, (list, tuple)) else (fns,):
        _RULES[fn] = rule
        wrapper_for(fn)


def wrapper_for(fn: Callable) -> Callable:
    """The dispatching wrapper of op function `fn` (made once)."""
    w = _WRAPPERS.get(fn)
    if w is None:
        w = _WRAPPERS[fn] = _make_wrapper(fn)
    return w


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


def _own(fn: Callable) -> Callable:
    """A function that runs fn's own code even while fn's code is a trampoline."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    _OWN_CODE[fn] = fn.__code__
    return copy


def _make_wrapper(fn: Callable) -> Callable:
    name = getattr(fn, "__name__", repr(fn))
    own = _own(fn)

    def batched_call(*args: Any, **kwargs: Any) -> Any:
        level = innermost_level(args, kwargs)
        if level is None:
            special = _UNBATCHED_HOOKS.get(fn)
            return own(*args, **kwargs) if special is None else special(own, args, kwargs)
        rule = _RULES.get(fn)
        if rule is None:
            raise NotImplementedError(
                f"vmap: there is no batching rule for core op '{name}' yet, so it cannot take "
                "a batched tensor; compute it outside vmap (core/func/rules*.py list the ops "
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
# `randomness=`); `hook(own, args, kwargs)`, where `own` runs the op's own code.
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


_TARGET = "__shoal_vmap_dispatch_target__"


def _trampoline(fn: types.FunctionType) -> types.CodeType:
    """Code for fn that calls fn's wrapper with the same arguments; it has fn's free variables
    (unused), since a function's code can only be swapped for code with as many."""
    code = _TRAMPOLINES.get(fn)
    if code is not None:
        return code
    own = _OWN_CODE[fn]
    cells = ", ".join(f"c{i}" for i in range(len(own.co_freevars)))
    source = (f"def outer({cells}):\n"
              f"    def trampoline(*args, **kwargs):\n"
              f"        return {_TARGET!r}(*args, **kwargs)\n"
              + (f"        ({cells},)\n" if cells else "")  # after return: free, never run
              + "    return trampoline\n")
    with warnings.catch_warnings():  # "str is not callable": the constant is swapped below
        warnings.simplefilter("ignore", SyntaxWarning)
        module = compile(source, f"<vmap dispatch of {fn.__qualname__}>", "exec")
    outer = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    inner = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    names = {"co_name": own.co_name}
    if hasattr(own, "co_qualname"):  # Python 3.11+
        names["co_qualname"] = own.co_qualname
    consts = tuple(_WRAPPERS[fn] if c == _TARGET else c for c in inner.co_consts)
    code = _TRAMPOLINES[fn] = inner.replace(co_consts=consts, **names)
    return code


def install() -> None:
    """Point every registered op at its wrapper (counted: nested vmaps share)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for fn in list(_OWN_CODE):
            fn.__code__ = _trampoline(fn)


def uninstall() -> None:
    """Give every op its own code back when the last vmap returns."""
    global _users
    with _lock:
        _users -= 1
        if _users > 0:
            return
        for fn, code in list(_OWN_CODE.items()):
            fn.__code__ = code
