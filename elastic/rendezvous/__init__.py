"""Rendezvous: the state machine (handler) above a compare-and-set backend (store or etcd).

The names load on first use (PEP 562): the launcher imports `rendezvous.registry` for the rules
of its flags without loading the handler, its sealing (cryptography) or a store.
"""

import importlib

# public name -> module that defines it
_LAZY = {
    "RendezvousHandler": "shoal.elastic.rendezvous.handler",
    "create_backend": "shoal.elastic.rendezvous.registry",
    "create_handler": "shoal.elastic.rendezvous.registry",
}

__all__ = ["RendezvousHandler", "create_backend", "create_handler"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
