"""`BridgeWork`, the torch Work of the bridge's ops: its error reaches torch's C++ readers of the
Future (DDP's reducer) as an error, while `wait()` raises shoal's own exception."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shoal.collectives.api import CompletedWork  # noqa: E402
from shoal.collectives.types import PeerLost  # noqa: E402
from shoal.torch_bridge.work import BridgeWork  # noqa: E402

LOST = "Rank 0 failed all_reduce #3 of group 'default': rank 2 was lost."


def test_a_failed_op_raises_shoals_error_from_wait_and_a_runtime_error_from_its_future():
    work = BridgeWork([], [torch.ones(2)], error=PeerLost(LOST))
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), PeerLost)
    with pytest.raises(PeerLost, match="rank 2 was lost"):
        work.wait()
    future = work.get_future()
    assert future.done()
    # A real error of the Future (raised in a then-callback), which C++ readers such as DDP's
    # reducer see; torch's Python set_exception would have stored the exception as the value.
    with pytest.raises(RuntimeError, match=r"PeerLost: Rank 0 failed all_reduce #3 .*rank 2"):
        future.wait()
    chained = future.then(lambda f: f.value())
    with pytest.raises(RuntimeError, match="rank 2 was lost"):
        chained.wait()


def test_a_finished_op_hands_its_tensors_to_the_future_and_its_callbacks():
    t = torch.arange(4.0)
    work = BridgeWork([CompletedWork([t])], [t])
    future = work.get_future()
    assert work.get_future() is future  # one Future per Work, as DDP expects
    (got,) = future.wait()
    assert got is t  # the very tensor, written in place; no copy
    assert future.then(lambda f: f.value()[0] * 2).wait().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert work.wait() and work.is_success() and work.exception() is None
