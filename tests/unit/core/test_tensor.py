"""Tensor basics: constructors, dtypes (bfloat16 included), devices, conversions, seeding."""

import pickle

import ml_dtypes
import numpy as np
import pytest

from shoal import core
from shoal.core.backend import Device
from shoal.core.errors import DeviceError, ShoalError


def test_tensor_infers_dtypes_like_torch_and_copies():
    assert core.tensor([1.0, 2.0]).dtype == core.float32
    assert core.tensor([1, 2]).dtype == core.int64
    assert core.tensor([True, False]).dtype == core.bool
    assert core.tensor(3.5).shape == ()
    src = np.arange(3, dtype=np.float64)
    t = core.tensor(src)
    assert t.dtype == core.float64 and not np.shares_memory(t.array, src)
    assert core.tensor(src, dtype=core.float16).dtype == core.float16
    assert core.tensor([1, 2], dtype="float32").dtype == core.float32
    assert core.as_tensor(src).array is src and core.from_numpy(src).array is src


def test_constructors():
    assert core.zeros(2, 3).shape == (2, 3) and core.zeros((2, 3)).numpy().sum() == 0
    assert core.ones(4, dtype=core.int32).dtype == core.int32
    assert core.full((2,), 7).dtype == core.int64 and core.full((2,), 7.0).tolist() == [7.0, 7.0]
    assert core.empty(3, 1).shape == (3, 1)
    x = core.randn(5, 2, dtype=core.float64)
    assert core.zeros_like(x).dtype == core.float64 and core.ones_like(x).numpy().sum() == 10
    assert core.arange(5).tolist() == [0, 1, 2, 3, 4] and core.arange(5).dtype == core.int64
    assert core.arange(0, 1, 0.25).dtype == core.float32
    assert core.rand(100).numpy().min() >= 0 and core.rand(100).numpy().max() < 1
    assert core.randn(3, requires_grad=True).requires_grad
    assert core.eye(3).numpy().trace() == 3
    assert core.randn(2, 2, dtype=core.bfloat16).dtype == core.bfloat16


def test_manual_seed_makes_randn_and_rand_reproducible():
    core.manual_seed(42)
    a, b = core.randn(4), core.rand(3)
    core.manual_seed(42)
    np.testing.assert_array_equal(a.numpy(), core.randn(4).numpy())
    np.testing.assert_array_equal(b.numpy(), core.rand(3).numpy())
    assert core.initial_seed() == 42


def test_metadata_and_conversions():
    x = core.arange(6, dtype=core.float32).reshape(2, 3)
    assert x.shape == (2, 3) and x.ndim == 2 and x.dim() == 2 and x.numel() == 6
    assert x.size() == (2, 3) and x.size(1) == 3 and len(x) == 2
    assert x.device == "cpu" and x.device == Device("cpu") and str(x.device) == "cpu"
    assert x[1, 2].item() == 5.0 and float(x[0, 1]) == 1.0 and int(x[1, 0]) == 3
    assert x.numpy() is x.array  # shares memory, no copy
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert x.to(core.float64).dtype == core.float64 and x.to("cpu") is x
    assert x.double().dtype == core.float64 and x.half().dtype == core.float16
    assert x.long().dtype == core.int64 and x.bool().dtype == core.bool
    assert x.to(dtype=core.float32) is x
    with pytest.raises(ValueError, match="only one-element tensors"):
        x.item()
    with pytest.raises(core.AutogradError, match=r"detach\(\)\.numpy\(\)"):
        core.ones(2, requires_grad=True).numpy()


def test_array_is_assignable_without_copy_and_clone_copies():
    x = core.zeros(3, requires_grad=True)
    arr = np.ones(3)
    x.array = arr
    assert x.array is arr
    c = x.clone()
    assert not np.shares_memory(c.array, x.array) and c.requires_grad
    d = x.detach().clone()
    assert not d.requires_grad


def test_dtype_objects():
    assert core.float32 == "float32" and core.float32 == np.float32
    assert core.bfloat16.np == np.dtype(ml_dtypes.bfloat16) and core.bfloat16.itemsize == 2
    assert core.float32.is_floating_point and not core.int64.is_floating_point
    assert repr(core.float16) == "core.float16" and core.float is core.float32
    assert pickle.loads(pickle.dumps(core.bfloat16)) is core.bfloat16
    with pytest.raises(core.DTypeError, match="Unknown dtype 'float8'"):
        core.zeros(2, dtype="float8")


def test_bfloat16_arithmetic_and_autograd():
    x = core.tensor([1.0, 2.0, 3.0], dtype=core.bfloat16, requires_grad=True)
    y = (x * 0.5 + x.sigmoid()).sum()
    assert y.dtype == core.bfloat16
    y.backward()
    assert x.grad.dtype == core.bfloat16
    xv = np.array([1.0, 2.0, 3.0])
    s = 1 / (1 + np.exp(-xv))
    np.testing.assert_allclose(x.grad.numpy().astype(np.float64), 0.5 + s * (1 - s), atol=1e-2)
    assert (x.float() @ core.ones(3)).dtype == core.float32


def test_unknown_devices_raise_device_errors():
    with pytest.raises(DeviceError, match="Unknown device 'tpu'"):
        core.zeros(2, device="tpu")
    with pytest.raises(DeviceError, match="bad index"):
        core.zeros(2, device="cuda:x")
    assert issubclass(DeviceError, ShoalError)


def test_cuda_without_cupy_names_the_fix():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(DeviceError, match="cupy is not installed"):
            core.zeros(2, device="cuda")
        with pytest.raises(DeviceError, match="cupy is not installed"):
            core.ones(2).to("cuda:0")
    else:
        pytest.skip("cupy is installed; tests/gpu covers cuda")


def test_repr_and_hash_by_identity():
    x = core.tensor([1.0, 2.0])
    assert repr(x).startswith("tensor([1., 2.]")
    assert "dtype=core.float64" in repr(core.zeros(1, dtype=core.float64))
    assert len({x, x, core.tensor([1.0, 2.0])}) == 2
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x > 0)


@pytest.mark.parametrize("value", [np.float64(1.8), np.float32(1.8), np.float16(1.5),
                                   np.int32(3), np.int64(3), np.uint8(3), np.bool_(True),
                                   1.8, 3, True])
def test_a_numpy_scalar_keeps_its_dtype_and_a_python_number_takes_torchs_default(value):
    import torch

    assert str(core.tensor(value).dtype).split(".")[-1] == str(torch.tensor(value).dtype).split(".")[-1]
