"""DLPack and zero-copy interop with numpy and torch."""

import numpy as np
import pytest

from shoal import core


def test_numpy_round_trip_shares_memory():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = core.from_dlpack(arr)
    assert t.array is arr
    back = np.from_dlpack(t)
    assert np.shares_memory(back, arr)
    t.array[0, 0] = 42
    assert back[0, 0] == 42
    assert t.__dlpack_device__() == (1, 0)


def test_torch_to_core_and_back_without_copies():
    torch = pytest.importorskip("torch")
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = core.from_dlpack(src)
    assert t.shape == (3, 4) and t.dtype == core.float32
    src[0, 0] = -1.0
    assert t.array[0, 0] == -1.0  # same memory
    back = torch.from_dlpack(t)
    assert back.data_ptr() == src.data_ptr()
    for dt, tdt in ((core.float64, torch.float64), (core.int64, torch.int64), (core.float16, torch.float16)):
        x = core.ones(2, dtype=dt)
        assert torch.from_dlpack(x).dtype == tdt


def test_non_contiguous_views_travel_too():
    torch = pytest.importorskip("torch")
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    t = core.from_dlpack(arr).T
    back = torch.from_dlpack(t)
    np.testing.assert_array_equal(back.numpy(), arr.T)


def test_bfloat16_dlpack_gives_a_clear_error():
    x = core.ones(2, dtype=core.bfloat16)
    with pytest.raises(core.DLPackError, match="bfloat16 cannot be exported through DLPack"):
        np.from_dlpack(x)
    assert issubclass(core.DLPackError, core.ShoalError)


def test_torch_bfloat16_import_gives_a_clear_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(core.DLPackError, match="numpy cannot import bfloat16 through DLPack"):
        core.from_dlpack(torch.ones(2, dtype=torch.bfloat16))


def test_from_dlpack_rejects_non_producers():
    with pytest.raises(core.DLPackError, match="does not implement __dlpack__"):
        core.from_dlpack([1, 2, 3])
