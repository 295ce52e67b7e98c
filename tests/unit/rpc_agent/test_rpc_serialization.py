"""Pickling for the wire: out-of-band buffers, Tensors, and remote exceptions."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.rpc_agent import RemoteException
from shoal.rpc_agent.serialization import (
    RemoteTraceback,
    deserialize,
    rebuild_exception,
    serialize,
    serialize_exception,
)


def test_contiguous_arrays_travel_out_of_band_without_copies():
    a = np.arange(1000, dtype=np.float64)
    b = np.ones((10, 10), dtype=np.int8, order="F")
    payload, buffers = serialize({"a": a, "b": b, "n": 3}, dst=1)
    assert len(buffers) == 2 and len(payload) < 400
    assert np.shares_memory(np.frombuffer(buffers[0], np.float64), a)
    back = deserialize(payload, [bytearray(x) for x in buffers])
    np.testing.assert_array_equal(back["a"], a)
    np.testing.assert_array_equal(back["b"], b)
    assert back["b"].flags.f_contiguous and back["n"] == 3


@pytest.mark.parametrize("make", [
    lambda: np.ones((12, 16)), lambda: np.arange(10, dtype=np.int8), lambda: np.array(3.5),
    lambda: np.zeros((0, 5), np.float32), lambda: np.ones((3, 4), dtype=">f4"),
    lambda: np.ones((4, 3)).T, lambda: np.array([1 + 2j]), lambda: np.array([True, False]),
    lambda: np.ones(3, np.float16), lambda: np.arange(12).reshape(3, 4)[:, ::2],
    lambda: np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), lambda: np.array(["ab", "c"]),
    lambda: np.ones(3, dtype=__import__("ml_dtypes").bfloat16),
], ids=["f8", "i1", "0-d", "empty", "big-endian", "fortran", "complex", "bool", "f2",
        "strided", "structured", "unicode", "bfloat16"])
def test_arrays_come_back_equal_writable_and_of_the_same_dtype(make):
    # plain dtypes take shoal's short form, the rest numpy's own: both must round-trip
    a = make()
    payload, buffers = serialize(a, dst=1)
    back = deserialize(payload, [bytearray(x) for x in buffers])
    assert type(back) is np.ndarray and back.dtype == a.dtype
    assert type(back.dtype) is type(a.dtype) and back.shape == a.shape
    np.testing.assert_array_equal(back, a)
    assert back.flags.writeable


def test_tensors_and_parameters_keep_type_data_and_requires_grad_but_not_the_graph():
    from shoal.core.nn.parameter import Parameter
    from shoal.core.tensor import Tensor

    x = Tensor(np.arange(4, dtype=np.float32), requires_grad=True)
    y = x * 2  # has a grad_fn, which must not travel
    p = Parameter(np.ones(3, dtype=np.float32))
    payload, buffers = serialize([x, y, p], dst=0)
    assert len(buffers) == 3
    bx, by, bp = deserialize(payload, buffers)
    assert type(bx) is Tensor and bx.requires_grad and bx.array.tolist() == [0, 1, 2, 3]
    assert type(by) is Tensor and by.grad_fn is None and by.array.tolist() == [0, 2, 4, 6]
    assert type(bp) is Parameter and bp.requires_grad


class _Local(Exception):
    pass


def _raise(exc):
    raise exc


def test_exceptions_come_back_as_their_own_type_with_the_remote_traceback():
    try:
        _raise(_Local("broken on purpose"))
    except _Local as exc:
        payload = serialize_exception(exc, "w3")
    rebuilt = rebuild_exception(payload, "mod.fn")
    assert type(rebuilt) is _Local and str(rebuilt) == "broken on purpose"
    assert "in _raise" in rebuilt.remote_traceback
    assert isinstance(rebuilt.__cause__, RemoteTraceback)
    assert rebuilt.__notes__ == ["Raised on worker 'w3' while running mod.fn (remote traceback "
                                 "above)."]


class _Unbuildable(Exception):
    def __init__(self, a, b):  # pickles, but cannot be rebuilt from its args
        super().__init__(f"{a}-{b}")


def test_exceptions_that_cannot_be_rebuilt_become_remote_exceptions():
    try:
        _raise(_Unbuildable(1, 2))
    except _Unbuildable as exc:
        payload = serialize_exception(exc, "w0")
    rebuilt = rebuild_exception(payload, "mod.fn")
    assert isinstance(rebuilt, RemoteException)
    assert rebuilt.type_name.endswith("._Unbuildable")
    assert str(rebuilt).startswith(f"{rebuilt.type_name}: 1-2\n\nRaised on worker 'w0'")
    with pytest.raises(RemoteException):
        raise rebuilt


def test_huge_exceptions_are_clipped_to_fit_one_frame():
    try:
        _raise(ValueError("x" * 5_000_000))
    except ValueError as exc:
        payload = serialize_exception(exc, "w1")
    assert len(payload) < 200_000
    rebuilt = rebuild_exception(payload, "mod.fn")
    assert isinstance(rebuilt, RemoteException) and rebuilt.type_name == "builtins.ValueError"
    assert "characters cut" in rebuilt.remote_message
