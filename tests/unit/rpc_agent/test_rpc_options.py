"""RpcBackendOptions validates and normalises its fields."""

from __future__ import annotations

import datetime

import pytest

from shoal.collectives.store.hash import HashStore
from shoal.rpc_agent import RpcBackendOptions


def test_defaults_and_timedelta_normalisation():
    options = RpcBackendOptions(rpc_timeout=datetime.timedelta(seconds=2.5), init_timeout=3)
    assert options.rpc_timeout == 2.5 and options.init_timeout == 3.0
    assert RpcBackendOptions().rpc_timeout == 60.0
    assert RpcBackendOptions().num_worker_threads == 16
    assert RpcBackendOptions().receive_cache_bytes == 256 * 1024 * 1024
    assert RpcBackendOptions(store=HashStore()).store is not None


@pytest.mark.parametrize("kwargs,match", [
    ({"init_method": "http://x"}, "must start with env://, tcp:// or file://, got 'http://x'"),
    ({"rpc_timeout": -1}, r"RpcBackendOptions.rpc_timeout: timeout must be zero or more"),
    ({"rpc_timeout": None}, "RpcBackendOptions.rpc_timeout must be given"),
    ({"num_worker_threads": 0}, "num_worker_threads must be a positive int, got 0"),
    ({"data_threshold": True}, "data_threshold must be a positive int of bytes, got True"),
    ({"receive_cache_bytes": -1},
     "receive_cache_bytes must be a non-negative int of bytes, got -1"),
    ({"receive_cache_bytes": 1.5},
     "receive_cache_bytes must be a non-negative int of bytes, got 1.5"),
    ({"store_prefix": "a/b"}, "store_prefix must be a non-empty name without '/'"),
])
def test_bad_values_are_rejected_with_the_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RpcBackendOptions(**kwargs)


def test_store_must_be_a_store():
    with pytest.raises(TypeError, match="must be a collectives.Store, got dict"):
        RpcBackendOptions(store={})
