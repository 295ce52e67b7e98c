"""The process-group backends by name, and whether each can run here.

A backend is imported only when asked for, so `import shoal.collectives` does not pay for it and
its optional dependency (cupy for nccl) is needed only where it is used. Each backend's group
class answers `check_backend_availability()` itself, as ray.util.collective's groups do.
A backend class is called as `cls(store, rank, size, timeout=..., name=..., global_ranks=...)`.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional, Union

from shoal.collectives.api import ProcessGroup
from shoal.collectives.types import BackendUnavailable

__all__ = ["Backend", "DEFAULT_BACKEND", "backend_names", "register_backend", "canonical_name",
           "check_backend_availability", "backend_class"]

Target = Union[str, Callable[..., ProcessGroup]]

DEFAULT_BACKEND = "tcp"
# name -> "module:Class" (imported on first use) or a callable building the group.
_BACKENDS: dict[str, Target] = {
    "tcp": "shoal.collectives.backends.tcp.group:ProcessGroupTCP",
    "nccl": "shoal.collectives.backends.nccl.group:ProcessGroupNCCL",
}
# torch's name for its CPU backend, which the tcp backend stands in for.
_ALIASES = {"gloo": "tcp"}


def backend_names() -> list[str]:
    """Every name `init_process_group(backend=...)` accepts, aliases included."""
    return sorted({*_BACKENDS, *_ALIASES})


def canonical_name(name: Optional[str]) -> str:
    """The backend a name (any case, alias or None for the default) stands for."""
    key = (name or DEFAULT_BACKEND).lower()
    return _ALIASES.get(key, key)


def register_backend(name: str, target: Target) -> None:
    """Make `init_process_group(backend=name)` use `target` ("module:Class" or a callable)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"A backend name must be a non-empty str, got {name!r}.")
    key = name.lower()
    _ALIASES.pop(key, None)
    _BACKENDS[key] = target


def _load(name: Optional[str]) -> Callable[..., ProcessGroup]:
    key = canonical_name(name)
    target = _BACKENDS.get(key)
    if target is None:
        raise BackendUnavailable(
            f"Unknown process-group backend {name!r}; known backends: "
            f"{', '.join(backend_names())}."
        )
    if callable(target):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(
            f"Backend {name!r} could not be imported from {module_name}: {exc}"
        ) from exc
    return getattr(module, attr)


def check_backend_availability(name: Optional[str]) -> Optional[str]:
    """None where backend `name` can run here; otherwise the sentence that says why not.

    Raises:
        BackendUnavailable: no backend has that name, or its module cannot be imported.
    """
    check = getattr(_load(name), "check_backend_availability", None)
    return None if check is None else check()


def backend_class(name: Optional[str]) -> Callable[..., ProcessGroup]:
    """The class (or factory) of backend `name`, once it is known to run here.

    Raises:
        BackendUnavailable: unknown name, or the backend cannot run here (the sentence says why).
    """
    cls = _load(name)
    check = getattr(cls, "check_backend_availability", None)
    reason = None if check is None else check()
    if reason is not None:
        raise BackendUnavailable(reason)
    return cls


class Backend(str):
    """A backend's name, as torch.distributed.Backend: `Backend("GLOO") == Backend.GLOO == "gloo"`.

    The name keeps the spelling asked for (lower-cased): "gloo" stays "gloo" although the tcp
    backend runs it. `Backend.register_backend(name, func)` is `register_backend`.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    UCC = "ucc"
    TCP = "tcp"

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            raise ValueError(f"Backend name must be a str, got {type(name).__name__}.")
        return str.__new__(cls, name.lower())

    @classmethod
    def register_backend(cls, name: str, func: Target, extended_api: bool = False,
                         devices: Optional[object] = None) -> None:
        """Register a backend under `name` (torch's extended_api and devices are accepted)."""
        register_backend(name, func)
        setattr(cls, name.upper(), name.lower())
