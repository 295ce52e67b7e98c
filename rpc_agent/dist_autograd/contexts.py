"""torch.distributed.autograd's context helpers beside `context`, `backward` and
`get_gradients`: `_new_context`, `_release_context`, `_current_context`, `_retrieve_context`,
`_is_valid_context`, `_get_max_id`, `_get_debug_info` and `is_available`. torch's own tests
and debugging scripts call them; they behave as torch's, with its error types (a
RuntimeError, here a DistAutogradError; a TypeError for an id that is not an int), and all
need init_rpc first, as torch's need its container initialized.

None of them is on a training step's path: `context`, `backward` and `get_gradients` do not
call them.
"""

from __future__ import annotations

from typing import Any

from shoal.rpc_agent import _current
from shoal.rpc_agent.context import _local as _context_local
from shoal.rpc_agent.dist_autograd import container, release
from shoal.rpc_agent.dist_autograd.container import _WORKER_SHIFT, DistAutogradContext
from shoal.rpc_agent.dist_autograd.engine import _check_id, context
from shoal.rpc_agent.dist_autograd.types import DistAutogradError

__all__ = ["DistAutogradContext", "is_available", "_new_context", "_release_context",
           "_current_context", "_retrieve_context", "_is_valid_context", "_get_max_id",
           "_get_debug_info"]


def is_available() -> bool:
    """Distributed autograd is always built into shoal (torch: whether it was compiled in)."""
    return True


def _new_context() -> DistAutogradContext:
    """Open a context and make it this thread's, without a `with` block (end it with
    `_release_context`).

    Raises:
        DistAutogradError: this thread already has a live context.
    """
    # The same checks and bookkeeping as `with context():`, whose exit is _release_context.
    cid = context().__enter__()
    return container.get(cid)


def _release_context(context_id: int) -> None:
    """End a live context on this worker (and, asynchronously, on its peers), as a `with
    context()` block's exit does; it stops being this thread's current context.

    Raises:
        DistAutogradError: no live context of that id on this worker.
        ContextIdTypeError: the id is not an int (a TypeError).
    """
    cid = _retrieve_context(context_id).context_id
    if getattr(_context_local, "context_id", None) == cid:
        _context_local.context_id = None
    release.end_here(cid, None)


def _current_context() -> DistAutogradContext:
    """This thread's live context: the one its `with context()` block opened, or the one of
    the RPC it is running.

    Raises:
        DistAutogradError: the thread has none.
    """
    _current.get()
    cid = getattr(_context_local, "context_id", None)
    ctx = container.get(cid) if cid is not None else None
    if ctx is None:
        raise DistAutogradError(
            "Current thread doesn't have a valid autograd context. Please wrap your code "
            "using: `with dist_autograd.context() as context_id` to generate a valid context"
        )
    return ctx


def _retrieve_context(context_id: int) -> DistAutogradContext:
    """The live context of that id on this worker.

    Raises:
        DistAutogradError: no live context of that id here (never made, or already ended).
        ContextIdTypeError: the id is not an int (a TypeError).
    """
    agent = _current.get()
    return container.retrieve(_check_id(context_id), agent.info.name)


def _is_valid_context(context_id: int) -> None:
    """Nothing when the context is live on this worker; raises as `_retrieve_context`
    otherwise (torch's contract: it answers by raising, not with a bool)."""
    _retrieve_context(context_id)


def _get_max_id() -> int:
    """The largest context id this worker can create: its worker id in the top 16 bits, the
    counter's largest value below."""
    agent = _current.get()
    return (agent.info.id << _WORKER_SHIFT) | ((1 << _WORKER_SHIFT) - 1)


def _get_debug_info() -> dict[str, Any]:
    """torch's two counters: live contexts and backward passes under way on this worker."""
    _current.get()
    return {"num_autograd_contexts": container.live_count(),
            "num_current_backward_passes": container.current_pass_count()}
