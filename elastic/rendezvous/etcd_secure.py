"""TLS and user/password for the etcd client, set through `--rdzv-conf` as torch's etcd
rendezvous does: `protocol` (http or https), `cacert`, `cert`, `key` (PEM files), plus `user`
and `password`. TLS is on with protocol=https (the system's CAs unless cacert names one), or
when cacert is given and protocol is not.

aetcd only opens insecure channels; `SecureClient` is its Client with a TLS channel. Its
`connect` mirrors aetcd 1.0's (stubs, authentication, watcher) with `secure_channel` in place of
`insecure_channel`; tests/integration/test_etcd_tls.py runs it against an etcd serving TLS with
client certificates and authentication.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

import aetcd
import grpc
from aetcd import rpc, watcher
from aetcd.client import _handle_errors

@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a secured etcd: TLS files and credentials (all optional)."""

    cacert: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    user: Optional[str] = None
    password: Optional[str] = None
    protocol: Optional[str] = None

    def __post_init__(self):
        if self.protocol is not None:
            protocol = str(self.protocol).strip().lower()
            if protocol not in ("http", "https"):
                raise ValueError(f"etcd protocol={self.protocol!r} is neither http nor https.")
            object.__setattr__(self, "protocol", protocol)
            if protocol == "http" and (self.cacert is not None or self.cert is not None):
                raise ValueError("etcd protocol=http turns TLS off, but cacert or cert was "
                                 "given; use protocol=https (or leave protocol out).")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd TLS needs both cert and key in --rdzv-conf, or neither.")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd authentication needs both user and password in --rdzv-conf, "
                             "or neither.")
        if self.cert is not None and not self.tls:
            raise ValueError("etcd TLS with a client certificate also needs cacert (the CA that "
                             "signed etcd's server certificate) or protocol=https (the "
                             "system's CAs).")
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None:
                try:
                    with open(path, "rb"):
                        pass
                except OSError as exc:
                    raise ValueError(f"etcd {name} file {path!r} cannot be read: "
                                     f"{exc.strerror or exc}") from exc

    @property
    def tls(self) -> bool:
        """Whether the channel is TLS."""
        if self.protocol is not None:
            return self.protocol == "https"
        return self.cacert is not None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the PEM files (no cacert: gRPC's default roots)."""
        def read(path: Optional[str]) -> Optional[bytes]:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(root_certificates=read(self.cacert),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))


class SecureClient(aetcd.Client):
    """aetcd's Client over a TLS channel."""

    def __init__(self, *args, credentials: grpc.ChannelCredentials, **kwargs):
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    @_handle_errors
    async def connect(self) -> None:
        """Open the TLS channel, authenticate if a user is set, and make the stubs."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(target, self._credentials,
                                              options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def make_client(host: str, port: int, security: Optional[EtcdSecurity], **kwargs) -> aetcd.Client:
    """An aetcd client for one endpoint, over TLS and with credentials as `security` says."""
    if security is None:
        return aetcd.Client(host=host, port=port, **kwargs)
    if security.tls:
        return SecureClient(host=host, port=port, username=security.user,
                            password=security.password, credentials=security.credentials(),
                            **kwargs)
    return aetcd.Client(host=host, port=port, username=security.user,
                        password=security.password, **kwargs)
