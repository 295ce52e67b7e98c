"""Where each worker's stdout and stderr go: torchrun's -r/--redirects and -t/--tee specs,
--local-ranks-filter, and --log-dir.

A spec is a bit mask per stream (1 stdout, 2 stderr, 3 both), for every local rank (`3`) or
per local rank (`0:3,1:2`). As torchrun: a redirected stream goes to its file only, a teed one
to its file and the console, any other to the console; the ranks filter only thins the
console. shoal also writes every stream to a file whenever --log-dir is given, so a failure
summary can always name a log.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional, Sequence

_SPEC = re.compile(r"^\s*[0-3]\s*$")
_PAIR = re.compile(r"^\s*(\d+)\s*:\s*([0-3])\s*$")
_WORDS = {"true": 3, "yes": 3, "on": 3, "false": 0, "no": 0, "off": 0}


@dataclasses.dataclass(frozen=True)
class StdSpec:
    """A mask for every local rank (`default`) or per local rank (`per_rank`)."""

    default: int = 0
    per_rank: Mapping[int, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "StdSpec":
        """`0`..`3`, or `LOCAL_RANK:MASK,...`; shoal's older switch values (true, yes) mean 3.

        Raises:
            ValueError: naming the value and the format.
        """
        raw = str(text).strip()
        if raw.lower() in _WORDS:
            return cls(_WORDS[raw.lower()])
        if _SPEC.match(raw):
            return cls(int(raw))
        per_rank = {}
        for part in raw.split(","):
            match = _PAIR.match(part)
            if match is None:
                raise ValueError(
                    f"{text!r} is not a stream spec: 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                    "or LOCAL_RANK:MASK pairs such as 0:1,1:2")
            per_rank[int(match.group(1))] = int(match.group(2))
        return cls(0, per_rank)

    def mask(self, local_rank: int) -> int:
        """The mask for one local rank."""
        return self.per_rank.get(local_rank, self.default)

    def __bool__(self) -> bool:
        return bool(self.default or any(self.per_rank.values()))


@dataclasses.dataclass(frozen=True)
class Route:
    """One worker's streams: to the console and to its log file, per (stdout, stderr)."""

    console: tuple[bool, bool]
    file: tuple[bool, bool]

    @property
    def needs_file(self) -> bool:
        """Whether a log file is written at all."""
        return any(self.file)


def route(local_rank: int, *, redirects: StdSpec, tee: StdSpec, log_dir: Optional[str],
          ranks_filter: Sequence[int] = ()) -> Route:
    """Where local rank `local_rank`'s stdout and stderr go."""
    bits = (1, 2)
    r, t = redirects.mask(local_rank), tee.mask(local_rank)
    shown = not ranks_filter or local_rank in ranks_filter
    console = tuple(shown and (not (r & b) or bool(t & b)) for b in bits)
    file = tuple(bool(log_dir) or bool((r | t) & b) for b in bits)
    return Route(console=console, file=file)  # type: ignore[arg-type]
