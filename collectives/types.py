"""The collectives layer's shared vocabulary: its errors, `ReduceOp` and a few constants.

A leaf: it imports nothing of its package, so every other module (the stores, the backends,
the array helpers, the API) can import it without a cycle.
"""

from __future__ import annotations

import enum

from shoal.core.errors import ShoalError

DEFAULT_STORE_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# Exit status of a worker that SHOAL_ASYNC_ERROR_HANDLING=1 ended after a failed collective; the
# elastic agent treats it as "restart the group" (EX_TEMPFAIL in sysexits.h).
ASYNC_ERROR_EXIT_CODE = 75


# ----------------------------------------------------------------------------- errors

class StoreError(ShoalError):
    """A store operation failed (connection lost, server gone, bad input)."""


class StoreTimeout(StoreError, TimeoutError):
    """A `get` or `wait` did not see its keys within the timeout; the message names them."""


class CollectiveError(ShoalError, RuntimeError):
    """A collective failed; the message names op, sequence number, group and the ranks at fault."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not finish within its timeout; names the ranks that never arrived."""


class CollectiveMismatch(CollectiveError):
    """Ranks called different collectives (op, dtype or shape) at one sequence number."""


class PeerLost(CollectiveError, ConnectionError):
    """A peer's connection closed or failed mid-collective; names the dead rank."""


class BackendUnavailable(CollectiveError):
    """A process-group backend cannot run here (unknown name, missing module or device)."""


class GroupDestroyed(CollectiveError):
    """A collective was called on a process group that was destroyed or never joined."""


class ReduceOp(enum.Enum):
    """Reductions for all_reduce, reduce and reduce_scatter."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
