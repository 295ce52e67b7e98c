"""tests/gpu runs only where cupy sees a CUDA device; elsewhere every test here is skipped."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device is usable through cupy, else why not."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any CUDA runtime failure means no device here
        return f"CUDA runtime unavailable: {exc}"
    return None if count > 0 else "no CUDA device"


def pytest_collection_modifyitems(config, items):
    """Mark every test here `gpu`, and skip it, saying why, where no CUDA device is usable."""
    reason = cuda_unavailable_reason()
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {reason}"))
