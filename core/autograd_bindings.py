"""torch.autograd's names that build on the ops: `Function`, the `function` and `profiler`
modules, and the create_graph engine.

core/autograd.py is the engine that every op imports, so it cannot import these; core's
namespace (core/_namespace.py) binds them onto it when built. A process may use core's
submodules directly (`from shoal.core.nn import Linear`) and never build the namespace, so
core/autograd.py asks this module for them on their first use. Imports nothing of core at load.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable

_AUTOGRAD = "shoal.core.autograd"
_NAMESPACE_BINDINGS = frozenset({"Function", "function", "profiler"})


def autograd_getattr(name: str) -> Any:
    """core.autograd's module `__getattr__`: Function, function and profiler, bound on demand."""
    if name in _NAMESPACE_BINDINGS:
        importlib.import_module("shoal.core._namespace")  # binds them onto core.autograd
        return vars(sys.modules[_AUTOGRAD])[name]
    raise AttributeError(f"module {_AUTOGRAD!r} has no attribute {name!r}")


def graph_engine() -> Callable:
    """The create_graph engine, `engine(roots, grads, retain_graph, capture)`.

    core/double_backward.py installs it into core.autograd when imported; it builds on the ops.
    """
    return importlib.import_module("shoal.core.double_backward").run_graph_backward


def _alias_on_first_use(alias: str, target: str) -> None:
    # `import shoal.core.autograd.function` resolves only through sys.modules (core/autograd.py
    # is not a package). The target is registered there now and executes on its first
    # attribute use (LazyLoader), so the alias is the very module `target` names.
    module = sys.modules.get(target)
    if module is None:
        spec = importlib.util.find_spec(target)
        spec.loader = importlib.util.LazyLoader(spec.loader)
        module = importlib.util.module_from_spec(spec)
        sys.modules[target] = module
        spec.loader.exec_module(module)
    sys.modules.setdefault(alias, module)


_alias_on_first_use(f"{_AUTOGRAD}.function", "shoal.core.autograd_function")
_alias_on_first_use(f"{_AUTOGRAD}.profiler", "shoal.core.autograd_profiler")
