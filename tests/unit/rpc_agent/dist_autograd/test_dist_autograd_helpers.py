"""dist_autograd's context helpers (issue 35) in a world of one; before init_rpc compared with
torch's. tests/multiproc/test_dist_autograd_context.py compares the rest with torch's."""

from __future__ import annotations

import pytest

from shoal import core, rpc_agent
from shoal.rpc_agent import dist_autograd


HELPERS = [
    ("_current_context", ()), ("_retrieve_context", (1,)), ("_is_valid_context", (1,)),
    ("_release_context", (1,)), ("_get_max_id", ()), ("_get_debug_info", ()),
    ("_new_context", ()), ("get_gradients", (1,)),
]


@pytest.mark.parametrize("name,args", HELPERS, ids=[name for name, _ in HELPERS])
def test_before_init_rpc_every_helper_raises_a_runtimeerror_as_torchs(name, args):
    torch_autograd = pytest.importorskip("torch.distributed.autograd")
    with pytest.raises(RuntimeError, match="Need to initialize distributed autograd"):
        getattr(torch_autograd, name)(*args)
    with pytest.raises(RuntimeError, match="RPC is not initialized in this process"):
        getattr(dist_autograd, name)(*args)


def test_is_available_as_torchs():
    torch_autograd = pytest.importorskip("torch.distributed.autograd")
    assert dist_autograd.is_available() is torch_autograd.is_available() is True


def test_a_call_to_itself_pairs_its_send_and_recv_keys(solo):
    with dist_autograd.context() as cid:
        ctx = dist_autograd._current_context()
        assert isinstance(ctx, dist_autograd.DistAutogradContext)
        assert (ctx._send_functions(), ctx._recv_functions(), ctx._known_worker_ids()) == (
            {}, {}, set())
        t = core.ones(2, requires_grad=True)
        rpc_agent.rpc_sync("solo", core.add, (t, 1))
        sends, recvs = ctx._send_functions(), ctx._recv_functions()
        # torch's layout: two sends (the argument, the result) and their two recvs, same keys.
        assert len(sends) == 2 and sorted(sends) == sorted(recvs)
        assert ctx._known_worker_ids() == {0} and dist_autograd._retrieve_context(cid) is ctx
        assert dist_autograd._get_debug_info() == {"num_autograd_contexts": 1,
                                                   "num_current_backward_passes": 0}
    assert dist_autograd._get_debug_info()["num_autograd_contexts"] == 0


def test_an_id_that_is_not_an_int_is_a_typeerror_and_a_dist_autograd_error(solo):
    for fn in (dist_autograd._retrieve_context, dist_autograd._is_valid_context,
               dist_autograd._release_context, dist_autograd.get_gradients):
        with pytest.raises(TypeError, match="context id is an int, got '1'") as caught:
            fn("1")
        assert isinstance(caught.value, dist_autograd.DistAutogradError)


def test_new_and_release_without_a_with_block(solo):
    ctx = dist_autograd._new_context()
    cid = ctx._context_id()
    assert dist_autograd._current_context() is ctx
    assert dist_autograd._is_valid_context(cid) is None
    with pytest.raises(RuntimeError, match="contexts do not nest"):
        dist_autograd._new_context()
    dist_autograd._release_context(cid)
    with pytest.raises(RuntimeError, match="Current thread doesn't have a valid autograd"):
        dist_autograd._current_context()
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id:? {cid}"):
        dist_autograd._release_context(cid)
    with dist_autograd.context() as again:  # the thread is free for a new context
        assert again != cid
