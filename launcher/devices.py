"""How many workers `--nproc-per-node cpu|gpu|auto` means on this machine.

CUDA devices are counted through cupy (shoal's GPU arrays) when it is installed; the count
honours CUDA_VISIBLE_DEVICES as the CUDA runtime does. No GPU library is imported otherwise.
"""

from __future__ import annotations

import os
from typing import Optional

_why: Optional[str] = None


def cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask, as torch's cpu_count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def gpu_count() -> int:
    """Visible CUDA devices, 0 without cupy or a driver (why_no_gpu() says which)."""
    global _why
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        _why = "CUDA_VISIBLE_DEVICES hides every device"
        return 0
    try:
        import cupy  # noqa: PLC0415  (optional dependency: the cuda extras)
    except ImportError:
        _why = "cupy is not installed; install shoal[cuda12] or shoal[cuda13]"
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001  (no driver, no device: cupy raises its own kinds)
        _why = f"the CUDA runtime reports: {exc}"
        return 0


def why_no_gpu() -> str:
    """Why the last gpu_count() found none."""
    return _why or "no device found"
