"""ReceiveBuffers reuses a block only once no array can see it, and stays within its bound."""

from __future__ import annotations

import gc
import pickle
import threading

import numpy as np
import pytest

from shoal.rpc_agent import metrics
from shoal.rpc_agent.transport import receive_buffers
from shoal.rpc_agent.transport.receive_buffers import MIN_CACHED_BYTES, ReceiveBuffers, size_class

MiB = 1 << 20


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_size_classes_waste_at_most_an_eighth():
    assert size_class(16 * MiB) == 16 * MiB
    assert size_class(16 * MiB + 1) == 18 * MiB
    assert size_class(3 * MiB - 5) == 3 * MiB
    for n in (MiB, MiB + 1, 5 * MiB + 77, 100 * MiB - 1):
        assert n <= size_class(n) <= n * 9 // 8 + 4096


def test_a_block_is_reused_once_the_array_is_gone():
    cache = ReceiveBuffers(64 * MiB)
    first = cache.get(4 * MiB)
    assert first.nbytes == 4 * MiB and first.dtype == np.uint8
    address = _address(first)
    del first
    again = cache.get(4 * MiB)
    assert _address(again) == address
    assert cache.held_bytes == 4 * MiB


@pytest.mark.parametrize("keep", [
    lambda a: a.view(np.float32).reshape(2, -1),      # a typed view, as assembly makes
    lambda a: a[10:20],                               # a slice
    lambda a: memoryview(a),                          # a buffer export
    lambda a: pickle.loads(                           # an array rebuilt on it out of band
        pickle.dumps(a.view(np.float64), protocol=5, buffer_callback=lambda b: False),
        buffers=[pickle.PickleBuffer(a.view(np.float64))]),
    lambda a: [a],                                    # a plain reference
], ids=["view", "slice", "memoryview", "pickle5", "list"])
def test_a_block_any_view_still_sees_is_never_handed_out(keep):
    cache = ReceiveBuffers(64 * MiB)
    array = cache.get(2 * MiB)
    array[:] = 7
    holder = keep(array)
    del array
    gc.collect()
    other = cache.get(2 * MiB)
    other[:] = 1
    # The held view still reads its own data: a different block was given out.
    seen = np.frombuffer(holder[0] if isinstance(holder, list) else holder, dtype=np.uint8)
    assert (seen == 7).all()
    assert cache.held_bytes == 4 * MiB


def test_small_transfers_and_a_zero_capacity_bypass_the_cache():
    cache = ReceiveBuffers(64 * MiB)
    small = cache.get(MIN_CACHED_BYTES - 1)
    assert small.nbytes == MIN_CACHED_BYTES - 1 and cache.held_bytes == 0
    off = ReceiveBuffers(0)
    assert off.get(4 * MiB).nbytes == 4 * MiB
    assert off.held_bytes == 0


def test_capacity_bounds_the_blocks_and_free_blocks_make_room():
    cache = ReceiveBuffers(8 * MiB)
    a = cache.get(4 * MiB)
    b = cache.get(4 * MiB)
    assert cache.held_bytes == 8 * MiB
    # Full and both blocks in use: fresh memory, not cached.
    c = cache.get(2 * MiB)
    assert cache.held_bytes == 8 * MiB and c.nbytes == 2 * MiB
    del a
    # A free 4 MiB block is dropped to make room for a 2 MiB class.
    d = cache.get(2 * MiB)
    assert cache.held_bytes == 6 * MiB and d.nbytes == 2 * MiB
    # Larger than the whole capacity: never cached.
    e = cache.get(9 * MiB)
    assert e.nbytes == 9 * MiB and cache.held_bytes == 6 * MiB
    del b, c, d, e


def test_clear_stops_caching():
    cache = ReceiveBuffers(16 * MiB)
    cache.get(4 * MiB)
    cache.clear()
    assert cache.get(4 * MiB).nbytes == 4 * MiB and cache.held_bytes == 0


def test_the_free_count_was_calibrated_on_this_interpreter():
    assert receive_buffers._FREE_COUNT is not None
    blocks = [np.empty(8, np.uint8)]
    assert receive_buffers._first_free(blocks) == 0
    view = blocks[0][2:]
    assert receive_buffers._first_free(blocks) == -1
    del view


def test_the_gauge_follows_the_bytes_held():
    before = metrics.RECEIVE_CACHE_BYTES._value.get()
    cache = ReceiveBuffers(16 * MiB)
    a = cache.get(4 * MiB)
    assert metrics.RECEIVE_CACHE_BYTES._value.get() - before == 4 * MiB
    cache.clear()
    assert metrics.RECEIVE_CACHE_BYTES._value.get() == before
    assert a.nbytes == 4 * MiB  # an array in use outlives clear()


def test_concurrent_readers_never_share_a_block():
    cache = ReceiveBuffers(256 * MiB)
    errors = []

    def reader(tag: int) -> None:
        for _ in range(50):
            array = cache.get(MiB)
            array[:] = tag
            if not (array == tag).all():
                errors.append(tag)

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    # Each thread holds at most two blocks at once (its last array while asking for the next).
    assert cache.held_bytes <= 8 * MiB
