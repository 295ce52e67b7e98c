"""Device staging of one nccl launch: device buffers for host (numpy) arrays, and the copies
back after the collective, all on the group's stream.

Everything a launch hands NCCL is kept alive by its `NcclWork` until the work's event fired, and
host results are copied into the caller's arrays when the work finishes (`NcclWork.finish`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.collectives.backends.nccl.work import NcclWork

__all__ = ["DeviceStage"]


class DeviceStage:
    """One launch's staging on `stream` through `runtime`, owned by `work`."""

    def __init__(self, runtime: Any, stream: Any, work: NcclWork):
        self._rt = runtime
        self._stream = stream
        self._work = work

    def dev(self, arr: Any, upload: bool = True) -> Any:
        """The device array to hand NCCL for `arr` (itself when it is already on the device)."""
        work = self._work
        if self._rt.is_device_array(arr):
            work.keep(arr)
            return arr
        if upload:
            d, pinned = self._rt.upload(np.ascontiguousarray(arr), self._stream)
            work.keep(pinned)
        else:
            d = self._rt.empty(arr.shape, arr.dtype)
        work.keep(d)
        return d

    def back(self, d: Any, arr: Any) -> None:
        """After the collective, bring device array `d` back into host array `arr`."""
        if d is arr:
            return
        pinned = self._rt.download(d, self._stream)
        self._work.keep(pinned)
        self._work.copy_back_later(arr, pinned)

    def temp(self, shape: Any, dtype: Any) -> Any:
        """A scratch device array that lives as long as the work."""
        d = self._rt.empty(shape, dtype)
        self._work.keep(d)
        return d

    def flat_of(self, arrays: list, n: int, dtype: Any, upload: bool = True) -> tuple[Any, bool]:
        """(one flat device array over `arrays`, whether it is their own memory)."""
        rt = self._rt
        if all(rt.is_device_array(a) for a in arrays):
            base = rt.address(arrays[0])
            step = arrays[0].nbytes
            if all(rt.address(a) == base + i * step for i, a in enumerate(arrays)):
                flat = rt.flat_view(arrays[0], n * len(arrays))
                for a in arrays:
                    self._work.keep(a)
                return flat, True
        if not upload:
            return self.temp((n * len(arrays),), dtype), False
        if not any(rt.is_device_array(a) for a in arrays):
            host = np.concatenate([np.asarray(a).reshape(-1) for a in arrays])
            return self.dev(host), False
        flat = self.temp((n * len(arrays),), dtype)
        rt.flatten([self.dev(a) for a in arrays], flat)
        return flat, False
