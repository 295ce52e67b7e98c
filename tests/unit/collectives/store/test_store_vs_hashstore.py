"""Random sequences of store operations give the same answers on TCPStore and FileStore as on
HashStore, the reference implementation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.collectives.types import StoreTimeout
from shoal.collectives.store.file import FileStore
from shoal.collectives.store.hash import HashStore
from shoal.collectives.store.tcp import TCPStore

KEYS = st.sampled_from(["a", "b", "c", "dir/d"])
VALUES = st.sampled_from([b"", b"0", b"7", b"-3", b"x", b"\x00\xff"])
OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES),
    st.tuples(st.just("add"), KEYS, st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), KEYS, VALUES, VALUES),
    st.tuples(st.just("delete"), KEYS),
    st.tuples(st.just("check"), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("multi_set"), st.lists(st.tuples(KEYS, VALUES), max_size=3)),
    st.tuples(st.just("multi_get"), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("num_keys"),),
)


def apply(store, op):
    """Run one op and return its result, or the error's type and message."""
    name, *args = op
    try:
        if name == "get":
            return store.get(args[0], timeout=0)
        if name == "multi_get":
            return store.multi_get(args[0], timeout=0)
        if name == "multi_set":
            return store.multi_set([k for k, _ in args[0]], [v for _, v in args[0]])
        return getattr(store, name)(*args)
    except StoreTimeout as exc:
        # the store's name differs; the missing keys must not
        return ("StoreTimeout", str(exc).split(" that never appeared: ")[1])
    except ValueError as exc:
        return ("ValueError", str(exc))


def open_store(backend, tmp_path_factory):
    if backend == "tcp":
        return TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    return FileStore(tmp_path_factory.mktemp("fs") / "store", timeout=10)


@pytest.mark.parametrize("backend", ["tcp", "file"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=25))
def test_same_answers_as_hashstore(backend, ops, tmp_path_factory):
    reference = HashStore(timeout=10)
    with open_store(backend, tmp_path_factory) as store:
        for op in ops:
            assert apply(store, op) == apply(reference, op), f"{op} on {backend}"
