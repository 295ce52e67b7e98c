"""torch.autograd's names that build on the ops: `Function`, the `function` and `profiler`
modules, and the create_graph engine.

core/autograd.py is the engine that every op imports, so it cannot import these; core's
namespace (core/_namespace.py) binds them onto it when built. A process may use core's
submodules directly (`from shoal.core.nn import Linear`) and never build the namespace, so
core/autograd.py asks this module for them on their first use. Imports nothing of core at load.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable

_AUTOGRAD = "shoal.core.autograd"
_NAMESPACE_BINDINGS = frozenset({"Function", "function", "profiler"})


def autograd_getattr(name: str) -> Any:
    """core.autograd's module `__getattr__`: Function, function, profiler and Variable, bound on
    demand."""
    if name == "Variable":
        return importlib.import_module("shoal.core.autograd_variable").Variable
    if name in _NAMESPACE_BINDINGS:
        importlib.import_module("shoal.core._namespace")  # binds them onto core.autograd
        return vars(sys.modules[_AUTOGRAD])[name]
    raise AttributeError(f"module {_AUTOGRAD!r} has no attribute {name!r}")


def graph_engine() -> Callable:
    """The create_graph engine, `engine(roots, grads, retain_graph, capture)`.

    core/double_backward.py installs it into core.autograd when imported; it builds on the ops.
    """
    return importlib.import_module("shoal.core.double_backward").run_graph_backward


class _Alias(types.ModuleType):
    """sys.modules' entry for `shoal.core.autograd.function` (or `.profiler`) until first use.

    `import shoal.core.autograd.function` resolves only through sys.modules (core/autograd.py is
    not a package), and the module it names builds on the ops, so this stands in for it: the
    first attribute asked for imports the module, puts it in this entry's place and answers from
    it. Dunder probes load nothing (inspect.getmodule asks every module in sys.modules for its
    __file__, possibly while core is half imported).
    """

    def __init__(self, alias: str, target: str) -> None:
        super().__init__(alias)
        self._target = target

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__all__":
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        module = importlib.import_module(self._target)
        if sys.modules.get(self.__name__) is self:
            sys.modules[self.__name__] = module
        return getattr(module, name)


for _alias, _target in ((f"{_AUTOGRAD}.function", "shoal.core.autograd_function"),
                        (f"{_AUTOGRAD}.profiler", "shoal.core.autograd_profiler")):
    sys.modules.setdefault(_alias, _Alias(_alias, _target))
