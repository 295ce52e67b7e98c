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

# torch.distributed's exception tree (DistError is a RuntimeError), so that a script's
# `except RuntimeError` or `except dist.DistStoreError` catches shoal's errors as torch's; shoal's
# own classes below sit under the matching torch class and keep their messages.

class DistError(ShoalError, RuntimeError):
    """torch.distributed.DistError: the base of the errors below."""


class DistBackendError(DistError):
    """torch.distributed.DistBackendError: a collective failed in the backend."""


class DistStoreError(DistError):
    """torch.distributed.DistStoreError: a store operation failed or timed out."""


class DistNetworkError(DistError):
    """torch.distributed.DistNetworkError: a socket could not listen or connect."""


class StoreError(DistError):
    """A store operation failed (connection lost, server gone, bad input).

    A DistError; its timeout is a DistStoreError and its network failures DistNetworkErrors,
    as torch sorts the same failures.
    """


class StoreTimeout(StoreError, DistStoreError, TimeoutError):
    """A `get` or `wait` did not see its keys within the timeout; the message names them."""


class StoreUnreachable(StoreError, DistNetworkError):
    """A store client could not reach its server within the timeout (torch: DistNetworkError)."""


class StoreBindError(StoreError, DistNetworkError, OSError):
    """A store server could not listen on its address (torch: DistNetworkError, EADDRINUSE);
    still an OSError carrying the errno, for code that catches that."""

    def __init__(self, *args):
        # RuntimeError's __init__ comes first in the MRO and would skip OSError's (errno, text).
        OSError.__init__(self, *args)


class CollectiveError(DistBackendError):
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
    BAND = "band"  # bitwise and, or, xor: integer and bool dtypes
    BOR = "bor"
    BXOR = "bxor"
    # A SUM of every rank's input times a factor; the factor travels in a PremulSum, which
    # make_premul_sum (torch: _make_nccl_premul_sum) builds.
    PREMUL_SUM = "premul_sum"


class PremulSum:
    """ReduceOp.PREMUL_SUM with its factor: each rank's input is scaled by `factor`, then summed.

    torch has it on NCCL only; shoal runs it on every backend (scaling, then a SUM).
    """

    op = ReduceOp.PREMUL_SUM

    def __init__(self, factor: float):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"PREMUL_SUM's factor must be a number, got {type(factor).__name__}.")
        self.factor = factor

    def __repr__(self) -> str:
        return f"ReduceOp.PREMUL_SUM(factor={self.factor!r})"


def make_premul_sum(factor: float) -> PremulSum:
    """The PREMUL_SUM reduction with `factor` (torch.distributed._make_nccl_premul_sum)."""
    return PremulSum(factor)


# ----------------------------------------------------------------------------- torch's options

class _Options:
    """Options of torch's ProcessGroup methods (`opts.reduceOp`, `opts.timeout`, ...)."""

    def __init__(self, **values):
        self.timeout = None  # None or a timedelta: the group's default timeout
        for name, value in values.items():
            if not hasattr(self, name):
                raise TypeError(f"{type(self).__name__} has no option {name!r}.")
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class AllreduceOptions(_Options):
    """`opts.reduceOp` (SUM) and `opts.timeout` of `pg.allreduce`."""

    reduceOp = ReduceOp.SUM


class AllreduceCoalescedOptions(AllreduceOptions):
    """Options of `pg.allreduce_coalesced`."""


class ReduceScatterOptions(AllreduceOptions):
    """Options of `pg._reduce_scatter_base`."""


class BroadcastOptions(_Options):
    """`opts.rootRank` (the group rank that sends) and `opts.timeout` of `pg.broadcast`."""

    rootRank = 0
    rootTensor = 0


class ReduceOptions(AllreduceOptions):
    """`opts.rootRank`, `opts.reduceOp` and `opts.timeout` of `pg.reduce`."""

    rootRank = 0
    rootTensor = 0


class GatherOptions(_Options):
    """`opts.rootRank` and `opts.timeout` of `pg.gather`."""

    rootRank = 0


class ScatterOptions(GatherOptions):
    """`opts.rootRank` and `opts.timeout` of `pg.scatter`."""


class AllgatherOptions(_Options):
    """`opts.timeout` of `pg.allgather`."""


class AllToAllOptions(_Options):
    """`opts.timeout` of `pg.alltoall`."""


class BarrierOptions(_Options):
    """`opts.timeout` of a barrier."""
