"""The rendezvous backends by name ("store", "etcd"): their rules, and factories that import
each implementation lazily.

`BACKENDS` is the one list of backends: the launcher's `--rdzv-backend` help and check come
from it. The rules of endpoints and backend options live here too, so that `shoal run` checks
them as it parses its flags and `create_backend` checks them again for callers in code, with
the same words. The etcd backend pulls in aetcd and gRPC, the store backend a TCPStore client;
neither is imported until asked for.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, Union

from shoal.core.timeouts import TimeoutLike, to_seconds
from shoal.elastic.api import (
    DEFAULT_BACKEND_TIMEOUT_S,
    RendezvousBackend,
    RendezvousSettings,
    check_lease_ttl,
)

if TYPE_CHECKING:  # annotations only: the launcher's flags import this module for its rules
    from shoal.collectives.store.api import Store
    from shoal.elastic.rendezvous.handler import RendezvousHandler

__all__ = ["BACKENDS", "DEFAULT_ETCD_PREFIX", "ETCD_SECURITY_KEYS", "ETCD_TORCH_ALIASES",
           "BackendKind", "backend_options", "check_backend", "check_endpoints",
           "check_etcd_prefix", "create_backend", "create_handler", "parse_endpoint"]

Endpoint = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class BackendKind:
    """What a rendezvous backend needs: a summary for --help, its options and endpoints."""

    summary: str
    # `--rdzv-conf` keys the backend takes -> what they mean.
    options: Mapping[str, str]
    # At most this many endpoints (None: any number); at least one is always needed.
    max_endpoints: Optional[int]
    # Port 0 stands for "any free port": only a node that hosts the server can bind one.
    port_zero: bool


# The etcd backend's security options (as torch's etcd rendezvous: protocol, cacert, cert,
# key), text rather than numbers; elastic.rendezvous.etcd_secure applies them.
ETCD_SECURITY_KEYS: Mapping[str, str] = {
    "protocol": "http or https (as torch's etcd rendezvous; https turns TLS on, with the "
                "system's CAs unless cacert names one)",
    "cacert": "PEM file of the CA that signed etcd's server certificate (turns TLS on)",
    "cert": "PEM file of this node's client certificate (with key)",
    "key": "PEM file of the client certificate's private key",
    "user": "etcd user name (with password)",
    "password": "etcd user's password",
}
# torch's etcd-v2 backend spells three of them differently; both spellings are taken.
ETCD_TORCH_ALIASES: Mapping[str, str] = {"ca_cert": "cacert", "ssl_cert": "cert",
                                         "ssl_cert_key": "key"}
# Where the etcd keys of a run live: <etcd_prefix>/<run_id>/ (torch's etcd rendezvous calls
# the same option etcd_prefix; its default is /torchelastic/p2p).
DEFAULT_ETCD_PREFIX = "/shoal"

BACKENDS: Mapping[str, BackendKind] = {
    "store": BackendKind(
        "a TCPStore: embedded in the node at --rdzv-endpoint, or a standalone `shoal store`",
        options={}, max_endpoints=1, port_zero=True),
    "etcd": BackendKind(
        "etcd v3 servers",
        options={"ttl": "seconds an etcd lease outlives its last keepalive (2 to 3600)",
                 "etcd_prefix": "the etcd key prefix the run's keys live under, as "
                                f"<etcd_prefix>/<run id>/ (default {DEFAULT_ETCD_PREFIX})",
                 **ETCD_SECURITY_KEYS,
                 **{alias: f"torch's etcd-v2 name for {key}"
                    for alias, key in ETCD_TORCH_ALIASES.items()}},
        max_endpoints=None, port_zero=False),
}


def check_backend(name: str) -> BackendKind:
    """The backend called `name`.

    Raises:
        ValueError: no backend has that name.
    """
    kind = BACKENDS.get(name)
    if kind is None:
        raise ValueError(f"Unknown rendezvous backend {name!r}; choose one of {list(BACKENDS)}.")
    return kind


def parse_endpoint(text: str, default_port: Optional[int] = None) -> Endpoint:
    """`HOST:PORT` or `[IPV6]:PORT` (or `HOST` alone, given a default port) as (host, port).

    Raises:
        ValueError: naming the endpoint and the rule.
    """
    text = str(text).strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"Rendezvous endpoint {text!r} is not '[IPV6]:PORT'.")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" not in text:
        host, port_text = text, ""
    else:
        raise ValueError(f"Rendezvous endpoint {text!r} is not 'HOST:PORT' (write IPv6 as "
                         "'[ADDR]:PORT').")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"Rendezvous endpoint {text!r} has no valid host.")
    port_text = port_text.strip()
    if not port_text and default_port is not None:
        return host, default_port
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"Rendezvous endpoint {text!r} is not 'HOST:PORT' with a port in "
                         "0..65535.")
    return host, int(port_text)


def check_endpoints(name: str, endpoints: Sequence[Endpoint]) -> None:
    """Check that backend `name` can use `endpoints` (how many, which ports).

    Raises:
        ValueError: an unknown backend, or endpoints it cannot use.
    """
    kind = check_backend(name)
    if not endpoints:
        raise ValueError(f"The {name} rendezvous backend needs at least one 'HOST:PORT' "
                         "endpoint.")
    if kind.max_endpoints is not None and len(endpoints) > kind.max_endpoints:
        raise ValueError(f"The {name} rendezvous backend needs exactly one 'HOST:PORT' "
                         f"endpoint, got {len(endpoints)}.")
    if not kind.port_zero:
        for host, port in endpoints:
            if port == 0:
                raise ValueError(f"A {name} endpoint needs a real port, not 0 (got {host}:0).")


def backend_options(name: str, options: Mapping[str, object]) -> dict[str, object]:
    """The keyword arguments of backend `name`'s constructor from its `--rdzv-conf` options.

    Raises:
        ValueError: an option the backend does not take, or a value its rule rejects.
    """
    kind = check_backend(name)
    # "security", "prefix": options already built by an earlier call (the launcher's, then
    # create_backend's).
    built = {"security", "prefix"} if name == "etcd" else set()
    unknown = sorted(set(options) - set(kind.options) - built)
    if unknown:
        known = sorted(kind.options) or "none"
        raise ValueError(f"The {name} rendezvous backend takes no option {unknown[0]!r} "
                         f"(its options: {known}).")
    options = _torch_spellings(options)
    kwargs: dict[str, object] = {}
    if "etcd_prefix" in options or "prefix" in options:
        kwargs["prefix"] = check_etcd_prefix(options.get("etcd_prefix", options.get("prefix")))
    security = {k: str(options[k]) for k in ETCD_SECURITY_KEYS if k in options}
    if security:
        from shoal.elastic.rendezvous.etcd_secure import (  # noqa: PLC0415  (loads aetcd)
            EtcdSecurity,
        )

        kwargs["security"] = EtcdSecurity(**security)  # ValueError names the missing half
    elif options.get("security") is not None:
        kwargs["security"] = options["security"]
    if "ttl" in options:
        try:
            kwargs["ttl"] = check_lease_ttl(float(options["ttl"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"The {name} rendezvous option ttl={options['ttl']!r} is invalid: "
                             f"{exc}") from exc
    return kwargs


def _torch_spellings(options: Mapping[str, object]) -> dict[str, object]:
    """`options` with torch's etcd-v2 names (ca_cert, ssl_cert, ssl_cert_key) as shoal's."""
    out = dict(options)
    for alias, key in ETCD_TORCH_ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if key in out and str(out[key]) != str(value):
            raise ValueError(f"The etcd rendezvous options {alias}={value!r} and {key}="
                             f"{out[key]!r} disagree ({alias} is torch's name for {key}); "
                             "give one.")
        out[key] = value
    return out


def check_etcd_prefix(prefix: object) -> str:
    """An etcd key prefix: an absolute path such as /shoal or /team/a (no trailing slash kept).

    Raises:
        ValueError: naming the value and the rule.
    """
    text = str(prefix).strip().rstrip("/")
    if not str(prefix).strip().startswith("/") or not text or "//" in text or \
            any(c.isspace() for c in text):
        raise ValueError(f"The etcd rendezvous option etcd_prefix={prefix!r} is not an "
                         "absolute key path such as /shoal or /team/jobs (a leading '/', no "
                         "empty parts or spaces).")
    return text


def _split_endpoints(endpoints: Union[str, Sequence[str], None]) -> list[str]:
    if endpoints is None:
        return []
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    return [e.strip() for e in endpoints if e and e.strip()]


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
    kwargs = backend_options(name, options)
    texts = _split_endpoints(endpoints)
    # Each backend is imported only when one is built: the launcher's flags import this
    # registry for its rules, and the etcd backend loads aetcd and grpc.
    if name == "store":
        from shoal.elastic.rendezvous.store_backend import (  # noqa: PLC0415  (import cost)
            StoreRendezvousBackend,
        )

        if store is None:
            parsed = [parse_endpoint(e) for e in texts]
            check_endpoints(name, parsed)
            from shoal.collectives.store.tcp import TCPStore  # noqa: PLC0415  (import cost)

            host, port = parsed[0]
            store = TCPStore(host, port, is_master=is_host, timeout=seconds)
        return StoreRendezvousBackend(store, run_id, timeout=seconds), store
    # etcd: endpoints may name a scheme ("http://h:2379"); the client takes them as given.
    check_endpoints(name, [parse_endpoint(e.split("://", 1)[-1]) for e in texts])
    from shoal.elastic.rendezvous.etcd_backend import (  # noqa: PLC0415  (import cost)
        EtcdRendezvousBackend,
    )
    from shoal.elastic.rendezvous.etcd_store import EtcdStore  # noqa: PLC0415  (import cost)

    backend = EtcdRendezvousBackend(texts, run_id, timeout=seconds, **kwargs)
    if store is None:  # the job's store keys sit under the run's own keys
        store = EtcdStore(texts, prefix=f"{backend.prefix}store/", timeout=seconds,
                          security=kwargs.get("security"))
    return backend, store


def create_handler(
    name: str,
    endpoints: Union[str, Sequence[str], None],
    settings: RendezvousSettings,
    node_id: str,
    **kwargs,
) -> RendezvousHandler:
    """`create_backend` plus a handler that owns (and on shutdown closes) backend and store."""
    # Imported when a handler is built, as each backend is (see create_backend).
    from shoal.elastic.rendezvous.handler import RendezvousHandler  # noqa: PLC0415

    backend, store = create_backend(name, endpoints, settings.run_id, **kwargs)
    timeout = kwargs.get("timeout", DEFAULT_BACKEND_TIMEOUT_S)
    return RendezvousHandler(backend, settings, node_id, store, owns=True,
                             backend_timeout=timeout)
