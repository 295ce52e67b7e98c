"""The value rules every store shares, as c10d has them: add's arithmetic and compare_set's outcome."""

from __future__ import annotations

from typing import Optional

__all__ = ["added", "compare_set_outcome", "not_an_integer"]


def not_an_integer(key: str, current: bytes) -> str:
    """The message for Store.add on a key whose value is not an integer."""
    return f"Store.add on key {key!r}, whose value {current[:32]!r} is not an integer."


def added(key: str, current: bytes, amount: int) -> int:
    """int(current) + amount; ValueError naming `key` when its value is not an integer."""
    try:
        return int(current) + amount
    except ValueError as exc:
        raise ValueError(not_an_integer(key, current)) from exc


def compare_set_outcome(
    current: Optional[bytes], expected: bytes, desired: bytes
) -> tuple[bool, bytes]:
    """(whether to store `desired`, the answer) for compare_set on a key holding `current`.

    A missing key matches only an empty `expected`; a missing key with a non-empty `expected`
    answers `expected`, as c10d does.
    """
    if current == expected or (current is None and expected == b""):
        return True, desired
    return False, expected if current is None else current
