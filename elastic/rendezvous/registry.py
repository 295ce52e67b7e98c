"""Build rendezvous backends and handlers by name ("store", "etcd"), importing each lazily.

The etcd backend pulls in aetcd and gRPC; the store backend a TCPStore client. Neither is
imported until asked for.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from shoal.collectives.store.api import Store
from shoal.core.timeouts import TimeoutLike, to_seconds
from shoal.elastic.api import DEFAULT_BACKEND_TIMEOUT_S, RendezvousBackend, RendezvousSettings
from shoal.elastic.rendezvous.handler import RendezvousHandler

__all__ = ["create_backend", "create_handler"]

BACKENDS = ("store", "etcd")


def _parse_endpoints(endpoints: Union[str, Sequence[str], None]) -> list[str]:
    if endpoints is None:
        return []
    if isinstance(endpoints, str):
        endpoints = [e for e in endpoints.split(",")]
    result = [e.strip() for e in endpoints if e and e.strip()]
    return result


def _host_port(endpoint: str, what: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} endpoint {endpoint!r} is not 'HOST:PORT' with a port in 0..65535.")
    return host.strip("[]"), int(port)


def create_backend(
    name: str,
    endpoints: Union[str, Sequence[str], None],
    run_id: str,
    *,
    store: Optional[Store] = None,
    is_host: bool = False,
    timeout: TimeoutLike = DEFAULT_BACKEND_TIMEOUT_S,
    **options,
) -> tuple[RendezvousBackend, Store]:
    """Build a rendezvous backend and the run's Store by backend name ("store" or "etcd").

    Raises:
        ValueError: an unknown name, a bad endpoint or an unknown option.
    """
    seconds = to_seconds(timeout, DEFAULT_BACKEND_TIMEOUT_S)
    if name == "store":
        if options:
            raise ValueError(f"The store rendezvous backend takes no options, got {sorted(options)}.")
        from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend

        if store is None:
            eps = _parse_endpoints(endpoints)
            if len(eps) != 1:
                raise ValueError(
                    f"The store rendezvous backend needs exactly one 'HOST:PORT' endpoint, "
                    f"got {endpoints!r}."
                )
            host, port = _host_port(eps[0], "Store rendezvous")
            from shoal.collectives.store.tcp import TCPStore

            store = TCPStore(host, port, is_master=is_host, timeout=seconds)
        return StoreRendezvousBackend(store, run_id, timeout=seconds), store
    if name == "etcd":
        eps = _parse_endpoints(endpoints)
        if not eps:
            raise ValueError("The etcd rendezvous backend needs at least one 'HOST:PORT' endpoint.")
        for ep in eps:
            _host_port(ep.split("://", 1)[-1], "etcd")
        unknown = set(options) - {"ttl"}
        if unknown:
            raise ValueError(f"Unknown etcd rendezvous options {sorted(unknown)}; known: ['ttl'].")
        from shoal.elastic.rendezvous.etcd_backend import EtcdRendezvousBackend
        from shoal.elastic.rendezvous.etcd_store import EtcdStore

        kwargs = {}
        if "ttl" in options:
            try:
                kwargs["ttl"] = float(options["ttl"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"etcd option ttl={options['ttl']!r} is not a number.") from exc
        backend = EtcdRendezvousBackend(eps, run_id, timeout=seconds, **kwargs)
        if store is None:
            store = EtcdStore(eps, prefix=f"/shoal/{run_id}/store/", timeout=seconds)
        return backend, store
    raise ValueError(f"Unknown rendezvous backend {name!r}; choose one of {list(BACKENDS)}.")


def create_handler(
    name: str,
    endpoints: Union[str, Sequence[str], None],
    settings: RendezvousSettings,
    node_id: str,
    **kwargs,
) -> RendezvousHandler:
    """`create_backend` plus a handler that owns (and on shutdown closes) backend and store."""
    backend, store = create_backend(name, endpoints, settings.run_id, **kwargs)
    timeout = kwargs.get("timeout", DEFAULT_BACKEND_TIMEOUT_S)
    return RendezvousHandler(backend, settings, node_id, store, owns=True,
                             backend_timeout=timeout)
