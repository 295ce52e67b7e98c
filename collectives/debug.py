"""`DebugLevel` and `get_debug_level`, torch.distributed's switch for extra checks and logs.

The level comes from SHOAL_DISTRIBUTED_DEBUG (or torch's TORCH_DISTRIBUTED_DEBUG) when first
asked for, and `set_debug_level` overrides it for this process.
"""

from __future__ import annotations

import enum
from typing import Optional

from shoal.collectives import env

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]


class DebugLevel(enum.Enum):
    """OFF, INFO or DETAIL, as torch.distributed.DebugLevel."""

    OFF = 0
    INFO = 1
    DETAIL = 2


_level: Optional[DebugLevel] = None


def _parse(text: str) -> DebugLevel:
    try:
        return DebugLevel[text.strip().upper()]
    except KeyError:
        raise ValueError(
            f"The debug level must be one of OFF, INFO or DETAIL, got {text!r} (from "
            "SHOAL_DISTRIBUTED_DEBUG or TORCH_DISTRIBUTED_DEBUG)."
        ) from None


def set_debug_level_from_env() -> None:
    """Read the level again from the environment."""
    global _level
    _level = _parse(env.distributed_debug())


def set_debug_level(level: DebugLevel) -> None:
    """Set this process's level."""
    global _level
    _level = level if isinstance(level, DebugLevel) else _parse(str(level))


def get_debug_level() -> DebugLevel:
    """This process's level (read from the environment the first time)."""
    if _level is None:
        set_debug_level_from_env()
    return _level
