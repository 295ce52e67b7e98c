"""The rendezvous state that backends store: a small JSON document, validated on every read.

JSON rather than pickle because the state comes from a shared server (etcd, a store) and
nothing is unpickled from there. For the same reason the handler seals the state: a "mac" field
holds the job's MAC over the canonical JSON of every other field (`sealing.Seal`), checked
before any field is acted on; who closed the rendezvous and how is part of what it covers. The state is an immutable value: decisions read it, and a
change is a new state (`dataclasses.replace`), so nothing can edit the copy another thread or a
retried compare-and-set still holds.
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Mapping, Optional

from shoal.elastic.api import RendezvousStateError
from shoal.elastic.rendezvous.sealing import Seal

FORMAT_VERSION = 2


_NODE_LISTS = ("participants", "wait_list", "expected", "dead", "lost")


@dataclasses.dataclass(frozen=True)
class RendezvousState:
    """One run's rendezvous: the current round and who is in, waiting, expected or lost."""

    round: int = 0
    complete: bool = False
    closed: bool = False
    # Join order while the round forms; rank order once it is complete.
    participants: tuple[str, ...] = ()
    # Nodes that arrived while the round ran; they join the next one.
    wait_list: tuple[str, ...] = ()
    # Nodes a forming round waits for before its last call: the previous round's survivors
    # and its waiters, so a restart completes as soon as they are back.
    expected: tuple[str, ...] = ()
    opened_at: float = 0.0
    min_reached_at: Optional[float] = None
    # Why the current (complete) round must end, once someone asked for that.
    restart: Optional[str] = None
    # Participants of the current round declared dead (heartbeat lapsed or left).
    dead: tuple[str, ...] = ()
    # Why this round was opened, and the previous round's nodes that were not carried over.
    reason: Optional[str] = None
    lost: tuple[str, ...] = ()
    # node id -> its latest heartbeat value; observers time how long a value stays the same.
    heartbeats: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Random, made by the node that created the state: the job's store keys live under it, so
    # a new job under a used run id (after the old state expired or was wiped) never reads the
    # old job's restart count or round keys.
    generation: str = ""
    # Who closed the rendezvous ("node id") and how: "finished" (every node's workers
    # succeeded) or "failed" (restarts ran out). A node whose workers still run when it sees a
    # close exits non-zero naming the closer unless the job failed for good.
    closed_by: Optional[str] = None
    closed_as: Optional[str] = None

    def __post_init__(self):
        # Lists in, tuples kept: callers may pass lists, and nobody can append to a snapshot.
        for name in _NODE_LISTS:
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "heartbeats", types.MappingProxyType(dict(self.heartbeats)))

    def encode(self, seal: Optional[Seal] = None) -> bytes:
        """The state as canonical JSON bytes, with its MAC when `seal` is given."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["heartbeats"] = dict(self.heartbeats)
        doc["format"] = FORMAT_VERSION
        if seal is not None:
            doc["mac"] = seal.state_mac(_canonical(doc))
        return _canonical(doc)

    @classmethod
    def decode(cls, raw: bytes, seal: Optional[Seal] = None,
               where: str = "the backend") -> "RendezvousState":
        """Parse and validate stored bytes; with `seal`, check the MAC before anything else.

        Raises:
            ForgedValueError: `seal` is given and the MAC is missing or wrong (names `where`).
            RendezvousStateError: not JSON, another format version, or fields of the wrong type.
        """
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RendezvousStateError(
                f"The stored rendezvous state is not JSON (it begins {bytes(raw[:40])!r})."
            ) from exc
        mac = doc.pop("mac", None) if isinstance(doc, dict) else None
        if seal is not None:
            seal.check_state(_canonical(doc) if isinstance(doc, dict) else b"", mac, where)
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
        _validate(doc)
        return cls(**doc)


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _validate(doc: dict) -> None:
    """Check a decoded document's field types; a missing field takes its default."""

    def bad(name: str, rule: str) -> RendezvousStateError:
        return RendezvousStateError(
            f"The stored rendezvous state's field {name!r} = {doc[name]!r} must be {rule}."
        )

    def present(*names: str):
        return [name for name in names if name in doc]

    for name in present("round"):
        if isinstance(doc[name], bool) or not isinstance(doc[name], int) or doc[name] < 0:
            raise bad(name, "an integer >= 0")
    for name in present("complete", "closed"):
        if not isinstance(doc[name], bool):
            raise bad(name, "true or false")
    for name in present(*_NODE_LISTS):
        if not isinstance(doc[name], list) or not all(isinstance(v, str) for v in doc[name]):
            raise bad(name, "a list of node ids")
    for name in present("generation"):
        if not isinstance(doc[name], str) or "/" in doc[name]:
            raise bad(name, "a string without '/'")
    for name in present("restart", "reason", "closed_by", "closed_as"):
        if doc[name] is not None and not isinstance(doc[name], str):
            raise bad(name, "a string or null")
    for name in present("opened_at", "min_reached_at"):
        if doc[name] is None and name == "min_reached_at":
            continue
        if isinstance(doc[name], bool) or not isinstance(doc[name], (int, float)):
            raise bad(name, "a number of seconds")
    for name in present("heartbeats"):
        if not isinstance(doc[name], dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in doc[name].items()
        ):
            raise bad(name, "an object of node id -> string")
    for name in present("participants"):
        if len(set(doc[name])) != len(doc[name]):
            raise bad(name, "free of duplicates")
