"""shoal: distributed training across processes and machines.

Everything imports under this one namespace, so a project's own `core` or `collectives`
package never collides with shoal's::

    from shoal import core, collectives
    import shoal.collectives as dist

The repository keeps one top-level folder per layer (core, collectives, rpc_agent, elastic,
launcher); the build maps each into this package (see setup.py).
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

_SUBPACKAGES = ("core", "collectives", "rpc_agent", "elastic", "launcher", "examples")


def __getattr__(name: str):
    # `import shoal; shoal.collectives` works without importing every layer up front.
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBPACKAGES))
