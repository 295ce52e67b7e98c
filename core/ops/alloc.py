"""Keep freed memory in the process (glibc malloc), so large op buffers stop page-faulting.

A training step allocates and frees the same large arrays every iteration (im2col matrices,
activations). glibc serves big requests with fresh mmap()s and trims the heap's free top, so
each step touches new pages: a digits convnet step spent as much CPU time in ~2000 minor page
faults as in its GEMMs. Raising the mmap and trim thresholds makes malloc reuse the freed
blocks (the effect jemalloc/tcmalloc give torch CPU users). Only glibc is tuned; elsewhere this
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX_THRESHOLD = 32 * 1024 * 1024  # glibc's cap for M_MMAP_THRESHOLD on 64-bit

_done = False


def retain_freed_memory(trim_threshold_bytes: int = 1 << 30) -> bool:
    """Serve arrays up to 32 MiB from the heap and keep up to `trim_threshold_bytes` of freed
    heap; True when glibc took the settings (idempotent)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.debug("no glibc mallopt here; the allocator is left as it is")
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, int(trim_threshold_bytes)) == 1 and ok
    _done = ok
    return ok
