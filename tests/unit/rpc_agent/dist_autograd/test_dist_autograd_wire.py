"""What the wire records for distributed autograd (no agent needed): pickling a Tensor that
requires grad inside a context records a send function, unpickling it a recv function naming
the sender and send id; nothing is recorded outside a context or for tensors without grad."""

from __future__ import annotations

import numpy as np

from shoal import core
from shoal.rpc_agent.dist_autograd import container
from shoal.rpc_agent.serialization import deserialize, serialize


def _roundtrip(obj, cid):
    payload, buffers = serialize(obj, dst=1, context_id=cid)
    return deserialize(payload, [bytearray(b) for b in buffers], src=0, context_id=cid)


def test_a_tensor_that_requires_grad_records_send_and_recv():
    cid = (5 << 48) | 1
    try:
        x = core.Tensor(np.arange(4.0), requires_grad=True)
        plain = core.Tensor(np.arange(3.0))
        back, back_plain = _roundtrip([x, plain], cid)
        ctx = container.get(cid)
        assert ctx is not None and ctx.creator_id == 5
        assert list(ctx.sends.values()) == [x]
        (tensor, src, send_id), = ctx.recvs.values()
        assert tensor is back and src == 0 and send_id in ctx.sends
        assert back.requires_grad and back.is_leaf and not back_plain.requires_grad
        np.testing.assert_array_equal(back.array, x.array)
        assert ctx.peers == {0, 1}
    finally:
        container.release(cid)
    assert container.get(cid) is None


def test_nothing_is_recorded_outside_a_context():
    before = container.live_count()
    x = core.Tensor(np.ones(2), requires_grad=True)
    back = _roundtrip(x, None)
    assert back.requires_grad and container.live_count() == before
