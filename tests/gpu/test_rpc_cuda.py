"""RPC with cupy arrays between two spawned workers: arrays travel through host memory (inline
and over the data channel), arrive as cupy arrays on the device they left from, and come back
to the caller on its device; CUDA core.Tensors keep requires_grad; numpy stays numpy."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")


def _device_count() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


def describe_and_double(x):
    """Runs on the callee: what arrived, and x * 2 on the same device."""
    import cupy

    from shoal.core.tensor import Tensor

    data = x.array if isinstance(x, Tensor) else x
    kind = "cupy" if isinstance(data, cupy.ndarray) else type(data).__name__
    where = int(data.device.id) if kind == "cupy" else -1
    grad = bool(getattr(x, "requires_grad", False))
    if kind == "cupy":
        with data.device:
            doubled = data * 2
    else:
        doubled = data * 2
    return kind, where, grad, doubled


def _worker(rank, world, port):
    import cupy

    from shoal import rpc_agent
    from shoal.collectives.store.tcp import TCPStore
    from shoal.core.tensor import Tensor

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=30)
    opts = rpc_agent.RpcBackendOptions(store=store, rpc_timeout=60, init_timeout=60)
    rpc_agent.init_rpc(f"w{rank}", rank, world, rpc_backend_options=opts)
    out = {}
    try:
        if rank == 0:
            small = cupy.arange(16, dtype=cupy.float32)
            big = cupy.arange(1 << 20, dtype=cupy.float64)  # 8 MiB: over the data channel
            out["small"] = rpc_agent.rpc_sync("w1", describe_and_double, args=(small,))
            out["big"] = rpc_agent.rpc_sync("w1", describe_and_double, args=(big,))
            t = Tensor(cupy.ones((3, 4), cupy.float32), requires_grad=True)
            out["tensor"] = rpc_agent.rpc_sync("w1", describe_and_double, args=(t,))
            out["numpy"] = rpc_agent.rpc_sync("w1", describe_and_double, args=(np.arange(3),))
            if cupy.cuda.runtime.getDeviceCount() > 1:
                with cupy.cuda.Device(1):
                    on1 = cupy.full(5, 3.0)
                out["dev1"] = rpc_agent.rpc_sync("w1", describe_and_double, args=(on1,))
            # Make the results picklable for the parent: what type and device came back.
            summary = {}
            for key, (kind, where, grad, doubled) in out.items():
                back = doubled.array if isinstance(doubled, Tensor) else doubled
                is_cupy = isinstance(back, cupy.ndarray)
                summary[key] = (kind, where, grad, is_cupy,
                                int(back.device.id) if is_cupy else -1,
                                cupy.asnumpy(back) if is_cupy else np.asarray(back))
            return summary
        return None
    finally:
        rpc_agent.shutdown()
        store.close()


def test_cupy_arrays_travel_and_return_on_their_device():
    from test_nccl import run_ranks

    summary = run_ranks(_worker, 2)[0]
    kind, where, grad, is_cupy, back_dev, value = summary["small"]
    assert (kind, where, is_cupy, back_dev) == ("cupy", 0, True, 0)
    np.testing.assert_array_equal(value, np.arange(16) * 2)
    kind, where, grad, is_cupy, back_dev, value = summary["big"]
    assert (kind, where, is_cupy, back_dev) == ("cupy", 0, True, 0)
    np.testing.assert_array_equal(value, np.arange(1 << 20) * 2.0)
    kind, where, grad, is_cupy, back_dev, value = summary["tensor"]
    assert (kind, where, grad, is_cupy) == ("cupy", 0, True, True)
    np.testing.assert_array_equal(value, np.full((3, 4), 2.0))
    kind, where, grad, is_cupy, back_dev, value = summary["numpy"]
    assert kind == "ndarray" and not is_cupy
    np.testing.assert_array_equal(value, [0, 2, 4])
    if _device_count() > 1:
        kind, where, grad, is_cupy, back_dev, value = summary["dev1"]
        assert (kind, where, is_cupy, back_dev) == ("cupy", 1, True, 1)
        np.testing.assert_array_equal(value, [6.0] * 5)
