"""The distributed autograd context a call belongs to: its id travels in every frame.

Distributed autograd (a later layer) opens a context on the caller; every RPC issued inside
`with context_id(cid):` carries `cid`, and the callee runs the function inside the same
context, so gradients can be routed back along the calls that produced them.
"""

from __future__ import annotations

import threading
from typing import Optional

_local = threading.local()


def current_context_id() -> Optional[int]:
    """The context id calls from this thread carry now (None outside a context)."""
    return getattr(_local, "context_id", None)


class context_id:  # noqa: N801  (used as a function: `with context_id(cid):`)
    """Make calls issued by this thread inside the block carry `cid`. (A class, not a
    generator: every call of a context and every distributed backward message passes here.)"""

    __slots__ = ("_cid", "_previous")

    def __init__(self, cid: Optional[int]) -> None:
        if cid is not None and (isinstance(cid, bool) or not isinstance(cid, int)):
            raise TypeError(f"A context id is an int, got {cid!r}.")
        self._cid = cid

    def __enter__(self) -> None:
        self._previous = getattr(_local, "context_id", None)
        _local.context_id = self._cid

    def __exit__(self, *exc: object) -> None:
        _local.context_id = self._previous
