"""Where the nccl backend cannot run (no cupy, no device, no NCCL library), it fails at init
with one clear sentence, and everything else still works."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from shoal import collectives
from shoal.collectives.backends.nccl import runtime as _nccl_runtime
from shoal.collectives.types import BackendUnavailable
from shoal.collectives.store.hash import HashStore

EXACT = r"^backend 'nccl' needs a CUDA device; none was found"


def _real_device_present() -> bool:
    return _nccl_runtime.unavailable_reason() is None


pytestmark = pytest.mark.skipif(_real_device_present(), reason="a usable CUDA device with NCCL is here")


@pytest.fixture(autouse=True)
def _no_default_group():
    yield
    collectives.destroy_process_group()


def _fake_cupy(monkeypatch, device_count, nccl_available=True):
    """Install a stand-in `cupy` whose runtime reports `device_count` (or raises it)."""
    def count():
        if isinstance(device_count, BaseException):
            raise device_count
        return device_count

    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available
    cuda.runtime = types.SimpleNamespace(getDeviceCount=count)
    cuda.nccl = nccl
    cupy.cuda = cuda
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, mod)


def _init_nccl():
    return collectives.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=5)


def test_without_cupy_init_fails_with_the_exact_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(BackendUnavailable, match=EXACT):
        _init_nccl()
    assert not collectives.is_initialized()
    assert _nccl_runtime.unavailable_reason().startswith("cupy is not installed")
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL

    with pytest.raises(BackendUnavailable, match=EXACT + r" \(cupy is not installed"):
        ProcessGroupNCCL(HashStore(), 0, 1)


@pytest.mark.parametrize("count, context", [
    (0, "cupy is installed but sees 0 CUDA devices"),
    (RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected"),
     "cupy is installed but the CUDA runtime reports no usable device: cudaErrorNoDevice"),
])
def test_cupy_without_a_device_fails_with_the_exact_sentence(monkeypatch, count, context):
    _fake_cupy(monkeypatch, count)
    with pytest.raises(BackendUnavailable, match=EXACT):
        _init_nccl()
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL

    with pytest.raises(BackendUnavailable, match=EXACT + r" \(" + context):
        ProcessGroupNCCL(HashStore(), 0, 1)


def test_device_without_the_nccl_library_says_what_to_install(monkeypatch):
    _fake_cupy(monkeypatch, 1, nccl_available=False)
    with pytest.raises(BackendUnavailable, match=EXACT + r" \(no device is usable for NCCL: cupy sees 1 "
                       r"CUDA device\(s\) but cannot load the NCCL library; install nvidia-nccl"):
        _init_nccl()


def test_this_machine_gives_the_sentence_and_everything_else_still_works():
    # Whatever this machine lacks (cupy, a driver, a device), the same sentence comes first.
    with pytest.raises(BackendUnavailable, match=EXACT):
        _init_nccl()
    with pytest.raises(BackendUnavailable, match=EXACT):
        _init_nccl()  # a failed init leaves nothing behind, so trying again gives the same
    pg = collectives.init_process_group("tcp", store=HashStore(), rank=0, world_size=1, timeout=5)
    x = np.arange(4.0)
    collectives.all_reduce(x)
    np.testing.assert_array_equal(x, np.arange(4.0))
    assert collectives.get_backend() == "tcp" and pg.size() == 1
