"""Elastic training: rendezvous (etcd, store), node agent, checkpoints and resumable state.

The rendezvous, checkpoint, state and agent names are imported lazily, on first use, so that
`import shoal.elastic` does not load aetcd or the agent.
"""

from __future__ import annotations

import importlib

from shoal.elastic.api import (
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
    "RendezvousHandler": "shoal.elastic.rendezvous.handler",
    "create_backend": "shoal.elastic.rendezvous.registry",
    "create_handler": "shoal.elastic.rendezvous.registry",
    "StoreRendezvousBackend": "shoal.elastic.rendezvous.store_backend",
    "EtcdRendezvousBackend": "shoal.elastic.rendezvous.etcd_backend",
    "EtcdStore": "shoal.elastic.rendezvous.etcd_store",
    "Checkpointer": "shoal.elastic.checkpoint",
    "State": "shoal.elastic.state",
    "Agent": "shoal.elastic.agent.agent",
}

__all__ = ["CheckpointError", "RendezvousBackend", "RendezvousClosedError", "RendezvousError",
           "RendezvousInfo", "RendezvousSettings", "RendezvousStateError",
           "RendezvousTimeoutError", "StoreHostLostError", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal.elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
