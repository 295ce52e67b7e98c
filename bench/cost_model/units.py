"""Byte units and how the cost model's tables print sizes and rates."""

from __future__ import annotations

KiB = 1024
MiB = 1024 * KiB


def fmt_size(n: float) -> str:
    """`n` bytes as the tables print it: 4 MiB, 1.5 KiB, 64 B."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.0f} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def gbps(per_byte: float) -> str:
    """A per-byte cost in seconds as GB/s ("inf" for a free byte)."""
    return f"{1 / per_byte / 1e9:.2f}" if per_byte > 0 else "inf"
