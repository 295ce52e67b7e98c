"""init_rpc fails only with RpcErrors, secrets included: a rendezvous store that turns this
worker's secret away (a real TCPStore server holding another one) and a secret that cannot be
used at all both raise RpcAuthenticationError, an RpcError that is still the AuthenticationError
it wraps (kept as its cause) and says how to set the secret."""

from __future__ import annotations

import re

import pytest

from shoal import rpc_agent
from shoal.collectives.store.tcp import TCPStore
from shoal.core.errors import AuthenticationError
from shoal.rpc_agent.types import RpcAuthenticationError

from tests.conftest import DEVELOPMENT_TOKEN_RULE as RULE

pytestmark = pytest.mark.timeout(60)

HOW_TO_SET = (
    "Give every worker the same secret: set SHOAL_AUTH_TOKEN (or SHOAL_AUTH_TOKEN_FILE, naming a "
    "file that holds it) in every worker's environment, or pass it as "
    "RpcBackendOptions(token=...); shoal run sets one for the whole job."
)


@pytest.fixture
def store_host():
    """The rendezvous store as worker rank 0 hosts it with tcp://, holding its own secret."""
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, wait_for_workers=False,
                     token="the-store-keepers-secret")
    yield store
    store.close()


@pytest.mark.parametrize("given_by", ["environment", "options"])
def test_a_secret_the_store_refuses_fails_init_with_an_rpc_error_saying_how_to_set_it(
        store_host, given_by, monkeypatch):
    token = None
    if given_by == "environment":
        monkeypatch.setenv("SHOAL_AUTH_TOKEN", "another-secret")
    else:
        token = "another-secret"  # the environment's suite token would be refused just the same
    options = rpc_agent.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{store_host.port}",
                                          init_timeout=5, token=token)
    message = (
        f"RPC: worker 'w1' (rank 1) could not finish init_rpc: the rendezvous store at "
        f"127.0.0.1:{store_host.port}, which worker rank 0 hosts, refused this worker's secret. "
        f"{HOW_TO_SET}"
    )
    # Twice: the first failure left no half-started worker behind (no "already initialized").
    for _ in range(2):
        with pytest.raises(RpcAuthenticationError, match=f"^{re.escape(message)}$") as info:
            rpc_agent.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=options)
        assert isinstance(info.value, rpc_agent.RpcError), type(info.value).__mro__
        assert isinstance(info.value, AuthenticationError), type(info.value).__mro__
        cause = info.value.__cause__
        assert type(cause) is AuthenticationError, repr(cause)
        assert "refused this process's secret" in str(cause), cause


def test_the_store_keeper_holding_the_workers_secret_is_not_refused(store_host):
    """The same store and worker with one secret get past the handshake: init then waits for
    rank 0, which never comes, and times out naming it (so the refusal above is the secret's)."""
    options = rpc_agent.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{store_host.port}",
                                          init_timeout=1, token="the-store-keepers-secret")
    with pytest.raises(rpc_agent.RpcTimeout,
                       match=r"^RPC: worker 'w1' waited in init_rpc 1s, but rank\(s\) 0 never "
                             r"joined\.$"):
        rpc_agent.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=options)


def test_the_development_token_for_a_store_off_loopback_fails_before_any_dial(no_secret):
    # 192.0.2.1 (TEST-NET-1) is never dialled: the check comes first, and its message is the
    # rule's, not a refusal.
    options = rpc_agent.RpcBackendOptions(init_method="tcp://192.0.2.1:29500", init_timeout=5)
    with pytest.raises(RpcAuthenticationError,
                       match=rf"^RPC: worker 'w1' \(rank 1\) could not finish init_rpc: the "
                             rf"rendezvous store at 192\.0\.2\.1:29500 uses "
                             rf"'192\.0\.2\.1', {RULE}"):
        rpc_agent.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=options)


def test_a_placeholder_secret_fails_init_with_an_rpc_error(tmp_path):
    options = rpc_agent.RpcBackendOptions(init_method=f"file://{tmp_path / 'rendezvous'}",
                                          init_timeout=5, token="change-me")
    with pytest.raises(RpcAuthenticationError,
                       match=r"^RPC: worker 'w0' \(rank 0\) could not finish init_rpc: The auth "
                             r"token is the placeholder 'change-me' from shoal's manifests, which "
                             r"everyone can read: set SHOAL_AUTH_TOKEN"):
        rpc_agent.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=options)
