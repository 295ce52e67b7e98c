"""The distributed autograd context a call belongs to: its id travels in every frame.

Distributed autograd (a later layer) opens a context on the caller; every RPC issued inside
`with context_id(cid):` carries `cid`, and the callee runs the function inside the same
context, so gradients can be routed back along the calls that produced them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

_local = threading.local()


def current_context_id() -> Optional[int]:
    """The context id calls from this thread carry now (None outside a context)."""
    return getattr(_local, "context_id", None)


@contextlib.contextmanager
def context_id(cid: Optional[int]) -> Iterator[None]:
    """Make calls issued by this thread inside the block carry `cid`."""
    if cid is not None and (isinstance(cid, bool) or not isinstance(cid, int)):
        raise TypeError(f"A context id is an int, got {cid!r}.")
    previous = getattr(_local, "context_id", None)
    _local.context_id = cid
    try:
        yield
    finally:
        _local.context_id = previous
