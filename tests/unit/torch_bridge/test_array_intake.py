"""collectives' array intake: any `__dlpack__` or array-interface object is used in place
(torch CPU tensors, bfloat16 included), and anything else is refused with its type named."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

from shoal.collectives import arrays
from shoal.collectives.dlpack import ForeignArrayError
from shoal.collectives.store.hash import HashStore

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int8,
                                   torch.bool, torch.complex64, torch.bfloat16, torch.float16])
def test_a_torch_tensor_is_unwrapped_in_place(dtype):
    t = torch.zeros(2, 3, dtype=dtype)
    arr = arrays.unwrap(t, "all_reduce tensor")
    assert arr.shape == (2, 3) and arr.flags.writeable
    arr[1, 2] = 1
    assert t[1, 2].item() == 1 and t.sum().item() == 1  # the write landed in torch's storage


def test_bfloat16_comes_in_as_ml_dtypes_bfloat16_and_outlives_the_name():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    arr = arrays.unwrap(t, "x")
    assert arr.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(arr.astype(np.float32), t.float().numpy())
    keep = t
    del t
    gc.collect()
    arr += ml_dtypes.bfloat16(1)  # the array keeps the tensor's memory alive by itself
    assert keep.float().tolist() == [[1, 2, 3], [4, 5, 6]]


def test_a_torch_view_with_an_offset_is_the_view_not_the_storage():
    base = torch.zeros(10, dtype=torch.bfloat16)
    arr = arrays.unwrap(base[4:7], "x")
    arr[:] = ml_dtypes.bfloat16(2)
    assert base.tolist() == [0, 0, 0, 0, 2, 2, 2, 0, 0, 0]


def test_reductions_on_bfloat16_match_torch():
    a = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    b = torch.tensor([0.5, 4.0, -1.0], dtype=torch.bfloat16)
    x, y = arrays.unwrap(a, "a"), arrays.unwrap(b, "b")
    arrays.ufunc(arrays.reduce_op("sum"))(x, y, out=x)
    # Every value and sum here is exact in bfloat16's 8-bit mantissa, so both sides agree exactly.
    assert a.tolist() == (torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16) + b).tolist()


def test_refusals_name_the_type_and_what_to_pass():
    with pytest.raises(ForeignArrayError, match=r"^x is a Tensor that refused to share its memory "
                       r"through DLPack: .*detach"):
        arrays.unwrap(torch.ones(3, requires_grad=True), "x")
    with pytest.raises(TypeError, match=r"got tuple; for a Python list or number pass np\.asarray"):
        arrays.unwrap((1, 2), "x")
    with pytest.raises(ValueError, match=r"^x must be C-contiguous to be used in place"):
        arrays.unwrap(torch.ones(4, 4).t(), "x")


class _Exporter:
    """A producer that offers only the array interface (as numba's and pyarrow's buffers do)."""

    def __init__(self, arr: np.ndarray):
        self.__array_interface__ = arr.__array_interface__
        self._arr = arr


def test_an_array_interface_object_is_used_in_place_and_a_read_only_one_refused():
    backing = np.zeros(4, np.float32)
    arrays.unwrap(_Exporter(backing), "x")[:] = 3
    assert backing.tolist() == [3, 3, 3, 3]
    frozen = np.zeros(4)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match=r"^x is read-only; collectives write .*it is a _Exporter"):
        arrays.unwrap(_Exporter(frozen), "x")


def test_a_single_rank_group_all_reduces_a_torch_tensor_in_place():
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP

    pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=10, name="intake")
    try:
        t = torch.full((5,), 2.0, dtype=torch.bfloat16)
        work = pg.all_reduce(t, op="max")
        assert work.result()[0] is t  # the Work hands back the caller's own tensor
        assert t.tolist() == [2.0] * 5
    finally:
        pg.shutdown()
