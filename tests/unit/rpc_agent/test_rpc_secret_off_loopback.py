"""Without a secret, an RPC worker refuses to bind an address other machines can reach: its
gRPC port runs code for whoever signs a hello with the development token, which is public."""

from __future__ import annotations

import pytest

from shoal import rpc_agent
from shoal.core.auth import _INSECURE_DEFAULT
from shoal.core.errors import AuthenticationError
from shoal.rpc_agent import RpcBackendOptions
from shoal.rpc_agent.transport.data_channel import DataChannels

from tests.conftest import DEVELOPMENT_TOKEN_RULE as RULE


def test_init_rpc_on_all_interfaces_needs_a_secret(no_secret):
    options = RpcBackendOptions(host="0.0.0.0", init_method="tcp://127.0.0.1:0")
    with pytest.raises(AuthenticationError, match=rf"RPC worker 'w0' binding its ports uses "
                       rf"'0\.0\.0\.0', {RULE}"):
        rpc_agent.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=options)


def test_the_data_channel_refuses_the_development_token_off_loopback():
    with pytest.raises(AuthenticationError, match=rf"data channel uses '0\.0\.0\.0', {RULE}"):
        DataChannels(name="w0", worker_id=0, token=_INSECURE_DEFAULT, host="0.0.0.0",
                     on_transfer=lambda *a: None, on_dead=lambda *a: None,
                     peer_label=lambda i: None)
    DataChannels(name="w0", worker_id=0, token=_INSECURE_DEFAULT, host="127.0.0.1",
                 on_transfer=lambda *a: None, on_dead=lambda *a: None,
                 peer_label=lambda i: None).close()
