"""Stores, process groups (tcp, nccl), the watchdog and DistributedDataParallel.

Names are imported lazily so that importing `collectives` for a store does not pay for the
backends, and a backend's optional dependency (cupy for nccl) is only needed when used.
"""

from __future__ import annotations

import importlib

from collectives.api import (  # noqa: F401  (re-exports)
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    PeerLost,
    ReduceOp,
    Store,
    StoreError,
    StoreTimeout,
)

# public name -> module that defines it
_LAZY = {
    "HashStore": "collectives.store_hash",
    "PrefixStore": "collectives.store_prefix",
    "TCPStore": "collectives.store_tcp",
    "FileStore": "collectives.store_file",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
