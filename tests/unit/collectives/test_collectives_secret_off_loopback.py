"""Without a secret, nothing in collectives serves or dials an address other machines can reach:
the development token is in shoal's source, so on such an address it would admit anyone."""

from __future__ import annotations

import datetime

import pytest

import shoal.collectives as dist
from shoal.collectives.backends.tcp.mesh import Mesh
from shoal.collectives.store.hash import HashStore
from shoal.core.errors import AuthenticationError

from tests.conftest import DEVELOPMENT_TOKEN_RULE as RULE


def test_init_process_group_over_tcp_on_all_interfaces_needs_a_secret(no_secret):
    with pytest.raises(AuthenticationError, match=rf"TCPStore at 0\.0\.0\.0:0 uses '0\.0\.0\.0', {RULE}"):
        dist.init_process_group("tcp", init_method="tcp://0.0.0.0:0", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=5))
    assert not dist.is_initialized()


def test_the_mesh_refuses_to_listen_off_loopback_with_the_development_token(no_secret):
    from shoal.core.auth import load_token

    mesh = Mesh(store=HashStore(), rank=0, size=2, name="default", host="0.0.0.0",
                token=load_token(), on_failure=lambda reason: None)
    try:
        with pytest.raises(AuthenticationError, match=rf"Rank 0 of group 'default' uses '0\.0\.0\.0', {RULE}"):
            mesh.connect(timeout=2)
    finally:
        mesh.close()
