"""Elastic training: rendezvous (etcd, store), node agent, checkpoints and resumable state.

Names are imported lazily so that `import elastic` does not load aetcd or the agent.
"""

from __future__ import annotations

import importlib

from elastic.api import (  # noqa: F401  (re-exports)
    CheckpointError,
    RendezvousBackend,
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreHostLostError,
)

# public name -> module that defines it
_LAZY = {
    "RendezvousHandler": "elastic.rendezvous",
    "create_backend": "elastic.registry",
    "create_handler": "elastic.registry",
    "StoreRendezvousBackend": "elastic.rdzv_store",
    "EtcdRendezvousBackend": "elastic.rdzv_etcd",
    "EtcdStore": "elastic.store_etcd",
    "Checkpointer": "elastic.checkpoint",
    "State": "elastic.state",
    "Agent": "elastic.agent",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
