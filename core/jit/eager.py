"""torch.jit's decorators for code that uses them in passing: shoal has no TorchScript
compiler, so `script`, `trace`, `ignore`, `unused` and `export` hand back the Python function
or module itself, which then runs eagerly with the same results (a torch script's
`@torch.jit.script` helpers keep working after renaming), and `is_scripting()` is False."""

from __future__ import annotations

from typing import Any, Callable


def script(obj: Any, optimize: Any = None, _frames_up: int = 0, _rcb: Any = None,
           example_inputs: Any = None) -> Any:
    """The function or module itself: shoal runs it eagerly (no TorchScript)."""
    return obj


def trace(func: Any, example_inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
    """The function or module itself: shoal runs it eagerly rather than recording a graph."""
    return func


def _identity_decorator(fn: Callable | None = None, **_: Any) -> Any:
    if fn is None:
        return lambda f: f
    return fn


ignore = _identity_decorator
unused = _identity_decorator
export = _identity_decorator


def is_scripting() -> bool:
    """False: shoal never compiles TorchScript."""
    return False


def is_tracing() -> bool:
    """False: shoal never traces."""
    return False
