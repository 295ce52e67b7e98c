"""Rendezvous: the state machine (handler) above a compare-and-set backend (store or etcd)."""

from shoal.elastic.rendezvous.handler import RendezvousHandler
from shoal.elastic.rendezvous.registry import create_backend, create_handler

__all__ = ["RendezvousHandler", "create_backend", "create_handler"]
