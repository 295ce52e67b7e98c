"""Why a tcp group failed (`FailureReason`), as abort notices carry it between ranks, and the
error class each kind of failure raises (`ERROR_CLASSES`)."""

from __future__ import annotations

import json

from shoal.collectives.types import CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerLost

__all__ = ["ERROR_CLASSES", "FailureReason"]

ERROR_CLASSES = {
    "timeout": CollectiveTimeout,
    "peer_lost": PeerLost,
    "mismatch": CollectiveMismatch,
    "error": CollectiveError,
}


class FailureReason:
    """Why a group failed: a kind (picks the error class), a clause naming the culprits, origin."""

    __slots__ = ("kind", "cause", "origin", "culprits", "dump_path")

    def __init__(self, kind: str, cause: str, origin: int, culprits=(), dump_path=None):
        self.kind = kind if kind in ERROR_CLASSES else "error"
        self.cause = cause
        self.origin = origin
        self.culprits = tuple(culprits)
        self.dump_path = dump_path

    @property
    def error_class(self):
        """The `CollectiveError` subclass a caller gets for this kind of failure."""
        return ERROR_CLASSES[self.kind]

    def to_bytes(self) -> bytes:
        """The reason as an abort notice's payload (the dump path stays local)."""
        return json.dumps(
            {"kind": self.kind, "cause": self.cause, "origin": self.origin,
             "culprits": list(self.culprits)}
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, sender: int) -> "FailureReason":
        """The reason in `sender`'s abort notice; a garbled one still names the sender."""
        try:
            d = json.loads(raw.decode())
            return cls(str(d["kind"]), str(d["cause"]), int(d["origin"]),
                       [int(c) for c in d.get("culprits", [])])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return cls("error", f"rank {sender} aborted the group with an unreadable reason", sender)
