"""The data package's errors (leaf module: imports nothing of core.data)."""

from __future__ import annotations

from shoal.core.errors import ShoalError


class DataLoaderError(ShoalError, RuntimeError):
    """A DataLoader could not produce a batch (a worker died, timed out or failed)."""


class WorkerDied(DataLoaderError):
    """A worker process exited while the loader still needed it; names the worker and its pid."""


class DataLoaderTimeout(DataLoaderError, TimeoutError):
    """No batch arrived within the loader's `timeout`."""


class CollateError(ShoalError, ValueError):
    """Samples that default_collate cannot stack (mismatched shapes, types or keys)."""


class WorkerError(DataLoaderError):
    """A worker's exception that cannot be re-raised as its own type (its message is kept)."""
