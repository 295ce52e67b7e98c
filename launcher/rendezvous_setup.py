"""`shoal run`'s rendezvous on this node: the address other nodes reach it at, its handler and
backend (hosting the embedded store where this node should), and the watch on another node's
store."""

from __future__ import annotations

import logging
from typing import Optional

from shoal.collectives.store.tcp import TCPStore
from shoal.collectives.types import StoreError
from shoal.core import netaddr
from shoal.core.auth import is_loopback
from shoal.elastic.agent.store_host import StoreHostWatch
from shoal.elastic.rendezvous import RendezvousHandler, create_backend
from shoal.launcher import flags

logger = logging.getLogger("shoal.run")


def local_addr(settings: flags.RunSettings) -> str:
    """Where the other nodes reach this node (its master store, its workers' ports).

    Default: loopback for a rendezvous on this machine, else the local address that routes to
    the rendezvous endpoint, never the hostname's /etc/hosts entry (127.0.1.1 on Debian).
    """
    if settings.local_addr:
        if not netaddr.is_local_address(settings.local_addr):
            flags.run_parser().error(
                f"argument --local-addr/--local_addr: {settings.local_addr!r} is not an address "
                "of this host; give one of its own addresses (see `ip addr`), or leave it out "
                "to use the one that routes to the rendezvous endpoint"
            )
        return settings.local_addr
    if not settings.rdzv_endpoints or all(is_loopback(h) for h, _ in settings.rdzv_endpoints):
        return "127.0.0.1"
    for host, _ in settings.rdzv_endpoints:
        address = netaddr.address_towards(host)
        if address is not None:
            return address
    flags.run_parser().error(
        f"argument --local-addr/--local_addr: no local address routes to the rendezvous "
        f"endpoint {describe_endpoints(settings)}; give --local-addr"
    )


def describe_endpoints(settings: flags.RunSettings) -> str:
    """The rendezvous endpoints as the user wrote them (HOST:PORT,...), or '' for none."""
    return ",".join(f"{h}:{p}" for h, p in settings.rdzv_endpoints)


def make_handler(settings: flags.RunSettings, node_id: str) -> tuple[RendezvousHandler, bool]:
    """This node's rendezvous handler and whether this process hosts the store; every value
    was checked by flags.parse_run.

    Raises:
        ShoalError, OSError, ValueError: the backend or its store cannot be reached or built.
    """
    timeout = float(settings.rdzv_conf.get("store_timeout", flags.DEFAULT_STORE_TIMEOUT_S))
    if settings.embedded_store and not settings.rdzv_endpoints:
        endpoint = "127.0.0.1:0"
    else:
        endpoint = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
                            for h, p in settings.rdzv_endpoints)
    kwargs = dict(settings.backend_options, timeout=timeout)
    hosted = settings.rdzv_backend == "store" and settings.embedded_store
    if settings.rdzv_backend == "store":
        kwargs["is_host"] = hosted
    if not hosted:
        # Said before the dial: a master port that accepts but never answers otherwise leaves
        # the console silent until the store timeout (the error then names the address too).
        logger.info("Joining the %s rendezvous at %s (run id %s); its store has %gs to answer",
                    settings.requested_backend, endpoint, settings.rdzv_id, timeout)
    if settings.try_host and not hosted:
        # torchrun's c10d: the endpoint names this machine, so host the store there; if another
        # agent on this machine already does, its port is taken and we are its client.
        try:
            backend, store = create_backend("store", endpoint, settings.rdzv_id,
                                            **dict(kwargs, is_host=True))
            hosted = True
        except OSError as exc:
            logger.info("The store at %s is hosted by another process (%s); joining it as a "
                        "client", endpoint, exc)
            backend, store = create_backend("store", endpoint, settings.rdzv_id, **kwargs)
    else:
        if hosted and settings.requested_backend == "static":
            endpoint = static_bind(settings.rdzv_endpoints[0])
        backend, store = create_backend(settings.rdzv_backend, endpoint, settings.rdzv_id,
                                        **kwargs)
    # Not owned: the agent leaves the rendezvous first, then tells the store's host it is done,
    # and only then are the backend and store closed (see launcher.job).
    handler = RendezvousHandler(backend, settings.rendezvous, node_id, store, owns=False,
                                backend_timeout=timeout)
    return handler, hosted


def static_bind(master: tuple[str, int]) -> str:
    """Where node rank 0 of a static rendezvous listens: the master address when it is one of
    this host's, else every interface, as torchrun's store does. Under Kubeflow the master
    address is the name of a Service, which may not resolve yet in its own pod; the store
    still admits only peers that prove the job's secret."""
    host, port = master
    if netaddr.is_local_address(host):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    logger.info("The master address %s is not this host's (yet): the store listens on every "
                "interface, port %d", host, port)
    return f"0.0.0.0:{port}"


def watch_store_host(settings: flags.RunSettings, handler: RendezvousHandler, agent,
                     hosted: bool) -> Optional[StoreHostWatch]:
    """On a node that uses another node's embedded store, end the agent within seconds of
    that node dying (see elastic.agent.store_host); None where there is nothing to watch."""
    if settings.rdzv_backend != "store" or hosted:
        return None
    rdzv = handler.settings
    lost_after = rdzv.heartbeat_timeout
    try:
        # A connection of its own with a short timeout: a probe stuck on a hung host must
        # fail well within lost_after, and must not queue behind the agent's own calls.
        probe = TCPStore(handler.store.host, handler.store.port, is_master=False,
                         timeout=max(0.5, lost_after / 3))
    except (StoreError, OSError) as exc:
        logger.warning("Cannot watch the rendezvous store at %s: %s", handler.store.address, exc)
        return None

    def on_lost(error) -> None:
        handler.abort(error)
        agent.store_host_lost(error)

    return StoreHostWatch(probe, handler.store.address, interval=rdzv.heartbeat_interval,
                          lost_after=lost_after, on_lost=on_lost).start()
