"""What the cost model assumes of shoal (mirrored constants) and the sizes it measures at."""

from __future__ import annotations

from pathlib import Path

from .units import KiB, MiB

ROOT = Path(__file__).resolve().parents[2]
# The documented command: the measuring peers are started through it too (`--peer ROLE`).
SCRIPT = ROOT / "bench" / "scale_model.py"
# Mirrors of shoal.collectives.constants (read, not imported, so the model states what it
# assumes).
SMALL_MAX_BYTES = 64 * KiB  # direct exchange up to here
DIRECT_MAX_RANKS = 8  # above this many ranks small all_reduces run as a tree
SHM_CHUNK_BYTES = 4 * MiB  # SHM_SLOT_BYTES
PIPELINE_PIECE_BYTES = 8 * MiB  # the two-level pipeline's pieces
SHM_W2_MIN_CHUNK_BYTES = 256 * KiB
SHM_CALIBRATION_SIZES = (256 * KiB, 4 * MiB, 32 * MiB)
SOCKET_BUFFER_BYTES = 256 * KiB
RING_FILL_BYTES = 2 * SOCKET_BUFFER_BYTES  # a send buffer as the kernel sizes it (twice SO_SNDBUF)
SHAPED_LINK_GBIT = 5.0  # the check's shaped links: far below what the CPUs copy over veth here
FIRST_BUCKET_BYTES = 1 * MiB  # shoal's DDP, as torch's
BUCKET_BYTES = 25 * MiB
PEER_TIMEOUT_S = 60.0
CALIBRATION_BYTES = 4 * KiB  # shoal's own per-message work is measured at this size

PINGPONG_SIZES = (64, 1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB)
STREAM_SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
MEMORY_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
MEMORY_WALK_BYTES = 64 * MiB  # far beyond any last-level cache here
