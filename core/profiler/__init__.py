"""torch.profiler's names over shoal: profile, schedule, record_function, trace handlers.

`profile` and the names beside it load on first use (PEP 562): collectives import this package
in every worker for its recorder state (`profiler.state`, `profiler.clock`), and a worker that
does not profile must not pay for what `profile` builds on (the op instrumentation, Tensor, the
data loader and optimizers). `shoal run --profile DIR` still starts each worker's job profiler
when this package is imported.
"""

import importlib as _importlib
import sys as _sys
import types as _types

from shoal.core import settings as _settings
from shoal.core.profiler.schedule import ProfilerAction, ProfilerError, schedule

# public name -> module that defines it
_LAZY = {
    "ProfilerActivity": "shoal.core.profiler.profile",
    "kineto_available": "shoal.core.profiler.profile",
    "profile": "shoal.core.profiler.profile",
    "record_function": "shoal.core.profiler.profile",
    "supported_activities": "shoal.core.profiler.profile",
    "tensorboard_trace_handler": "shoal.core.profiler.handlers",
}

__all__ = [
    "ProfilerAction",
    "ProfilerActivity",
    "ProfilerError",
    "kineto_available",
    "profile",
    "record_function",
    "schedule",
    "supported_activities",
    "tensorboard_trace_handler",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _ProfilerPackage(_types.ModuleType):
    """The package's module type: it keeps `profiler.profile` the class, never the module."""

    def __setattr__(self, name: str, value) -> None:
        # The import system sets each loaded submodule as an attribute of its package, and
        # profiler/profile.py may load (through job.py, instrument.py) before anyone asks for
        # `profile`.
        if name == "profile" and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _ProfilerPackage

if _settings.PROFILE_DIR.get():  # `shoal run --profile DIR`: every worker profiles a step window
    _importlib.import_module("shoal.core.profiler.job").start_from_env()
