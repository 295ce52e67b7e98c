"""shoal's compute core: tensors on numpy or cupy, autograd, nn, optim, CUDA kernels.

Importing `shoal.core`, or one of its leaf modules (config, settings, errors, timeouts, auth,
channel, netaddr), costs only that: the launcher, the node agent and a standalone store read
core's settings and secrets without loading numpy. Names load on first use (PEP 562):

- a submodule (`core.nn`, `core.linalg`, `from shoal.core import fft`) is imported on its own,
  so fft, linalg and special load scipy only when used;
- any other name (`core.Tensor`, `core.add`, `core.float32`, `core.tensor`) builds the
  torch-like namespace once, in core/_namespace.py.
"""

import importlib as _importlib
import sys as _sys
import types as _types

# torch.tensor (the creation function) shares its name with the module that defines Tensor.
_NAMESPACE_OVER_SUBMODULE = frozenset({"tensor"})


class _CorePackage(_types.ModuleType):
    """The package's module type: it keeps `core.tensor` the function, never the module."""

    def __setattr__(self, name: str, value) -> None:
        # The import system sets each loaded submodule as an attribute of its package; the
        # module core/tensor.py often loads before the namespace (collectives imports it).
        if name in _NAMESPACE_OVER_SUBMODULE and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


def __getattr__(name: str):
    # Private names and probes (__path__, __wrapped__, ...) never build the namespace.
    if name.startswith("_") and name != "__all__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _NAMESPACE_OVER_SUBMODULE and name != "__all__":
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists and failed to import: that is the error to see
    _importlib.import_module(f"{__name__}._namespace")  # once: it publishes onto this package
    try:
        return globals()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    __getattr__("__all__")  # builds the namespace, so that dir() lists it
    return sorted(set(globals()))


_sys.modules[__name__].__class__ = _CorePackage
