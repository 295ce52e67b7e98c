"""pin_memory=True stages a DataLoader's batches in page-locked host memory (cupy present)."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
from shoal.core import data

cp = pytest.importorskip("cupy")
HOST_MEMORY = 1  # cudaMemoryTypeHost: what pointerGetAttributes reports for pinned memory


def is_pinned(array: np.ndarray) -> bool:
    return cp.cuda.runtime.pointerGetAttributes(array.ctypes.data).type == HOST_MEMORY


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_are_pinned_and_keep_their_values(workers):
    ds = data.TensorDataset(np.arange(24, dtype=np.float32).reshape(12, 2), np.arange(12))
    loader = data.DataLoader(ds, batch_size=4, num_workers=workers, pin_memory=True)
    batches = list(loader)
    assert [b[1].array.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    for x, y in batches:
        assert isinstance(x, core.Tensor) and is_pinned(x.array) and is_pinned(y.array)
        np.testing.assert_array_equal(x.array[:, 1] - x.array[:, 0], 1.0)
    on_device = cp.asarray(batches[0][0].array)  # a pinned source copies asynchronously
    assert on_device.sum().item() == float(np.arange(8).sum())
