"""Defaults and tuning knobs of the process-group layer, in one table.

The tcp backend's size thresholds were chosen with `bench/allreduce.py` on a 2-core machine:
direct exchange wins while a message fits the socket buffers in one go, a single-threaded
non-blocking ring wins up to a few MiB, and a sender thread beside a blocking
receive-and-reduce wins above that, where the copy work of both directions must overlap.
"""

from __future__ import annotations

from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE, DEFAULT_COLLECTIVE_TIMEOUT_S

__all__ = [
    "ASYNC_ERROR_EXIT_CODE",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_GROUP_NAME",
    "SOCKET_BUFFER_BYTES",
    "SMALL_MAX_BYTES",
    "THREADED_MIN_BYTES",
    "PUMP_CHUNK_BYTES",
    "THREADED_CHUNK_MIN_BYTES",
    "THREADED_CHUNK_MAX_BYTES",
    "SHM_SLOT_BYTES",
]

DEFAULT_GROUP_NAME = "default"

# Fixed socket buffers: small ones keep the bytes in flight inside the CPU caches, which on
# loopback beats the kernel's autotuned multi-MiB buffers (see bench/allreduce.py).
SOCKET_BUFFER_BYTES = 256 * 1024
# Largest payload sent in one message by the direct (all-to-all exchange) algorithms; it must
# stay well below the socket buffers so that every rank can send before it receives (a larger
# one deadlocks until the watchdog fires: both ranks blocked in send).
SMALL_MAX_BYTES = 64 * 1024
assert 2 * SMALL_MAX_BYTES <= SOCKET_BUFFER_BYTES
# Small all_reduces of groups above this many ranks run as a tree (recursive doubling): the
# direct exchange's W-1 messages per rank win on a few ranks (one round trip) but grow with W.
DIRECT_MAX_RANKS = 8
# From this size on, all_reduce cuts its ring into larger chunks (below), and a ring whose
# links stay within the host runs them with a sender thread (on loopback the pumped ring wins
# up to 1 MiB, they tie at 2 MiB, the thread wins by ~1.5x at 4 MiB and above). A ring over a
# link to another host keeps the single-threaded pump with the same chunks: the sender thread's
# hand-offs cost the kernel twice the time in network-stack work there (64 MiB over veth
# between namespaces: W=2 55 ms threaded, 28-34 ms pumped; W=4 150 ms, 107-118 ms).
THREADED_MIN_BYTES = 2 * 1024 * 1024
# Chunk sizes: the unit of overlap between sending, receiving and reducing.
PUMP_CHUNK_BYTES = 256 * 1024
# The threaded ring cuts each rank's segment into about this many chunks, within the bounds:
# enough chunks to overlap the steps, few enough that hand-offs between the receiving and the
# sending thread stay rare (4 MiB chunks cut the CPU of a W=4 64 MiB all_reduce by a fifth).
THREADED_CHUNKS_PER_SEGMENT = 4
THREADED_CHUNK_MIN_BYTES = 512 * 1024
THREADED_CHUNK_MAX_BYTES = 4 * 1024 * 1024

# Shared-memory all_reduce (groups whose ranks all share a host, see `_pg_shm`): each rank's
# region holds three buffers of this size. 4 MiB chunks measured best at W = 3 and 4 (fewer
# barriers, still cache-sized); at W = 2 a quarter of the message, from 256 KiB up, lets the
# copy of one chunk overlap the peer's reduction of the previous one.
SHM_SLOT_BYTES = 4 * 1024 * 1024
SHM_W2_MIN_CHUNK_BYTES = 256 * 1024
# Two-level all_reduce (ranks on several hosts): arrays above this go through the pipeline of
# shared-memory and cross-host phases in pieces of this size (see `hierarchical`).
PIPELINE_PIECE_BYTES = 8 * 1024 * 1024

# Small-message receives poll this long before sleeping in the kernel: waking a sleeping
# receiver costs the sender an inter-processor interrupt, which on a VM costs more than the
# whole exchange. Only when every rank of the group can have its own core. The window must
# outlast a sleeping peer's wake-up and reply (about 60 us on these VMs), or one miss makes
# the peer miss in turn and both stay in the slow mode (50 us: 0.054 ms for a 4 KiB
# all_reduce in about half the runs; 100 or 200 us: 0.017 ms in every run). A poll that
# hits costs nothing more for a long window (see backends/tcp/spin.py).
SPIN_S = 200e-6

# Flight recorder: how many recent collectives a dump shows.
HISTORY_LENGTH = 64
# Watchdog cadence and the progress each rank publishes through the store.
WATCHDOG_TICK_S = 0.1
PROGRESS_PUBLISH_S = 0.5
# A collective running longer than this gets its progress published at once.
PROGRESS_EAGER_AFTER_S = 0.2
# How long the watchdog waits for other ranks' progress (the store may be down too).
PROGRESS_QUERY_TIMEOUT_S = 2.0
# After a data socket breaks, how long to wait for the control channel to say why.
LINK_REASON_GRACE_S = 2.0
# Auth handshake and hello on a new backend connection.
CONNECT_HANDSHAKE_TIMEOUT_S = 10.0
# Largest frame on the control channel (point-to-point payloads travel there).
MAX_CONTROL_FRAME_BYTES = 1 << 34
# Longest fingerprint accepted in a header.
MAX_FINGERPRINT_BYTES = 4096
