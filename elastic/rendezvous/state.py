"""The rendezvous state that backends store: a small JSON document, validated on every read.

JSON rather than pickle because the state comes from a shared server (etcd, a store) and
nothing is unpickled from there.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from shoal.elastic.api import RendezvousStateError

FORMAT_VERSION = 1


@dataclasses.dataclass
class RendezvousState:
    """One run's rendezvous: the current round and who is in, waiting, expected or lost."""

    round: int = 0
    complete: bool = False
    closed: bool = False
    # Join order while the round forms; rank order once it is complete.
    participants: list[str] = dataclasses.field(default_factory=list)
    # Nodes that arrived while the round ran; they join the next one.
    wait_list: list[str] = dataclasses.field(default_factory=list)
    # Nodes a forming round waits for before its last call: the previous round's survivors
    # and its waiters, so a restart completes as soon as they are back.
    expected: list[str] = dataclasses.field(default_factory=list)
    opened_at: float = 0.0
    min_reached_at: Optional[float] = None
    # Why the current (complete) round must end, once someone asked for that.
    restart: Optional[str] = None
    # Participants of the current round declared dead (heartbeat lapsed or left).
    dead: list[str] = dataclasses.field(default_factory=list)
    # Why this round was opened, and the previous round's nodes that were not carried over.
    reason: Optional[str] = None
    lost: list[str] = dataclasses.field(default_factory=list)
    # node id -> its latest heartbeat value; observers time how long a value stays the same.
    heartbeats: dict[str, str] = dataclasses.field(default_factory=dict)

    def encode(self) -> bytes:
        """The state as canonical JSON bytes."""
        doc = dataclasses.asdict(self)
        doc["format"] = FORMAT_VERSION
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "RendezvousState":
        """Parse and validate stored bytes.

        Raises:
            RendezvousStateError: not JSON, another format version, or fields of the wrong type.
        """
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RendezvousStateError(
                f"The stored rendezvous state is not JSON (it begins {bytes(raw[:40])!r})."
            ) from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise RendezvousStateError(
                f"The stored rendezvous state has format {found!r}; this shoal reads format "
                f"{FORMAT_VERSION}. Is another shoal version using the same run id?"
            )
        doc.pop("format")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(doc) - set(fields)
        if unknown:
            raise RendezvousStateError(
                f"The stored rendezvous state has unknown fields {sorted(unknown)}."
            )
        state = cls(**doc)
        state._validate()
        return state

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> RendezvousStateError:
            return RendezvousStateError(
                f"The stored rendezvous state's field {name!r} = {getattr(self, name)!r} "
                f"must be {rule}."
            )

        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < 0:
            raise bad("round", "an integer >= 0")
        for name in ("complete", "closed"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        for name in ("participants", "wait_list", "expected", "dead", "lost"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise bad(name, "a list of node ids")
        for name in ("restart", "reason"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise bad(name, "a string or null")
        for name in ("opened_at", "min_reached_at"):
            value = getattr(self, name)
            if value is None and name == "min_reached_at":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "a number of seconds")
        if not isinstance(self.heartbeats, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.heartbeats.items()
        ):
            raise bad("heartbeats", "an object of node id -> string")
        if len(set(self.participants)) != len(self.participants):
            raise bad("participants", "free of duplicates")
