"""BurstWriter, a stream's writer thread for bursts: every item queued before a wake-up is
drained, wake-ups that come before the thread runs are one drain, and the thread exits once its
drain says the stream is over."""

from __future__ import annotations

import threading
import time

from shoal.rpc_agent._threads import BurstWriter


class _Outbox:
    """What a stream's drain does, reduced to a list: take everything queued."""

    def __init__(self, delay_s: float = 0.0):
        self.lock = threading.Lock()
        self.queued: list[int] = []
        self.drained: list[int] = []
        self.drains = 0
        self.over = False
        self.delay_s = delay_s
        self.exited = threading.Event()

    def put(self, item: int) -> None:
        with self.lock:
            self.queued.append(item)

    def drain(self) -> bool:
        self.drains += 1
        time.sleep(self.delay_s)  # a gRPC write in progress while more frames queue
        with self.lock:
            self.drained += self.queued
            self.queued = []
            if self.over:
                self.exited.set()
                return False
        return True


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_every_frame_queued_before_a_wake_is_drained_and_wakes_coalesce():
    outbox = _Outbox(delay_s=0.002)
    writer = BurstWriter(outbox.drain, "test-writer")
    assert not writer.started

    def sender(base: int) -> None:
        for i in range(200):
            outbox.put(base + i)
            writer.wake()

    threads = [threading.Thread(target=sender, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert writer.started
    expected = sorted(k * 1000 + i for k in range(4) for i in range(200))
    assert _wait_for(lambda: sorted(outbox.drained) == expected), len(outbox.drained)
    # 800 wake-ups while each drain takes 2 ms: most of them find a drain already asked for.
    assert outbox.drains < 400, outbox.drains


def test_a_wake_after_a_drain_began_gets_a_drain_of_its_own():
    outbox = _Outbox(delay_s=0.02)
    writer = BurstWriter(outbox.drain, "test-writer")
    outbox.put(1)
    writer.wake()
    assert _wait_for(lambda: outbox.drains == 1)  # the first drain is under way (20 ms)
    outbox.put(2)
    writer.wake()
    assert _wait_for(lambda: outbox.drained == [1, 2])


def test_the_thread_exits_when_the_stream_is_over_and_wake_if_started_starts_none():
    idle = _Outbox()
    never = BurstWriter(idle.drain, "test-writer")
    never.wake_if_started()
    assert not never.started and idle.drains == 0
    outbox = _Outbox()
    writer = BurstWriter(outbox.drain, "test-writer")
    writer.wake()
    assert _wait_for(lambda: outbox.drains >= 1)
    outbox.over = True
    writer.wake_if_started()
    writer.wake_if_started()  # a second release before the thread runs is harmless
    assert outbox.exited.wait(5)
