"""dist_autograd's context helpers (issue 35) against torch's: the same scenario runs on w0 of
two shoal workers and of two torch workers (TensorPipe over loopback), and every observation
(ids, the send/recv functions of a call, the known workers, debug counters, gradients, and
the type of every error) must be equal; error messages must match torch's patterns."""

from __future__ import annotations

import multiprocessing
import re

import pytest

from tests.support.rpc_workers import RpcWorkers


def _raised(fn):
    """(is a RuntimeError, is a TypeError, message) of what `fn()` raises, or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001  (the observation is the exception itself)
        return isinstance(exc, RuntimeError), isinstance(exc, TypeError), str(exc)
    return None


def _peer_view(da, cid):
    """On the peer, inside the call's context: its send and recv keys and known workers."""
    ctx = da._retrieve_context(cid)
    return sorted(ctx._send_functions()), sorted(ctx._recv_functions()), \
        sorted(ctx._known_worker_ids())


def shoal_peer_view(cid):
    from shoal.rpc_agent import dist_autograd

    return _peer_view(dist_autograd, cid)


def torch_peer_view(cid):
    import torch.distributed.autograd as dist_autograd

    return _peer_view(dist_autograd, cid)


def _inside_a_context(obs, rpc, da, leaf, add, peer_view):
    with da.context() as cid:
        obs["cid_is_int"] = type(cid) is int
        obs["cid_worker"] = cid >> 48
        obs["current_is_it"] = da._current_context()._context_id() == cid
        obs["retrieved_is_it"] = da._retrieve_context(cid)._context_id() == cid
        obs["valid"] = da._is_valid_context(cid)
        obs["debug_inside"] = da._get_debug_info()
        obs["nested"] = _raised(lambda: da.context().__enter__())
        obs["new_inside"] = _raised(da._new_context)
        t = leaf()
        r = rpc.rpc_sync("w1", add, (t, 1.0))
        ctx = da._current_context()
        sends, recvs = sorted(ctx._send_functions()), sorted(ctx._recv_functions())
        obs["send_workers"] = [k >> 48 for k in sends]
        obs["recv_workers"] = [k >> 48 for k in recvs]
        obs["known"] = sorted(ctx._known_worker_ids())
        peer_sends, peer_recvs, obs["peer_known"] = rpc.rpc_sync("w1", peer_view, (cid,))
        # A send and the recv it pairs with on the other worker have the same key.
        obs["pairs"] = (sends == peer_recvs, recvs == peer_sends)
        obs["grads_before"] = len(da.get_gradients(cid))
        da.backward(cid, [(r * r).sum()])
        obs["grad"] = da.get_gradients(cid)[t].detach().numpy().tolist()
        obs["passes_after"] = da._get_debug_info()["num_current_backward_passes"]
    obs["retrieve_ended"] = _raised(lambda: da._retrieve_context(cid))
    obs["current_ended"] = _raised(da._current_context)


def _observe(rpc, da, leaf, add, peer_view) -> dict:
    """The scenario, on w0; `leaf()` makes a float64 leaf of two ones, `add` is the library's."""
    obs = {
        "available": da.is_available(),
        "outside": _raised(da._current_context),
        "max_id": da._get_max_id(),
        "debug_outside": da._get_debug_info(),
        "retrieve_unknown": _raised(lambda: da._retrieve_context(12345)),
        "valid_unknown": _raised(lambda: da._is_valid_context(12345)),
        "release_unknown": _raised(lambda: da._release_context(12345)),
        "retrieve_str": _raised(lambda: da._retrieve_context("1")),
        "gradients_str": _raised(lambda: da.get_gradients("1")),
    }
    _inside_a_context(obs, rpc, da, leaf, add, peer_view)
    nid = da._new_context()._context_id()
    obs["new_is_current"] = da._current_context()._context_id() == nid
    obs["new_again"] = _raised(da._new_context)
    da._release_context(nid)
    obs["released_current"] = _raised(da._current_context)
    obs["released_again"] = _raised(lambda: da._release_context(nid))
    with da.context() as cid:
        obs["after_release_a_context_opens"] = cid != nid
    return obs


def shoal_scenario() -> dict:
    from shoal import core, rpc_agent
    from shoal.rpc_agent import dist_autograd

    return _observe(rpc_agent, dist_autograd,
                    lambda: core.ones(2, dtype=core.float64, requires_grad=True), core.add,
                    shoal_peer_view)


def torch_scenario() -> dict:
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as trpc

    return _observe(trpc, dist_autograd,
                    lambda: torch.ones(2, dtype=torch.float64, requires_grad=True), torch.add,
                    torch_peer_view)


def _torch_worker(rank: int, world_size: int, init_file: str, scenario, results) -> None:
    import os

    os.environ.update(TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed.rpc as trpc

        torch.set_num_threads(1)
        opts = trpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}",
                                                rpc_timeout=30, _transports=["uv"],
                                                _channels=["basic"])
        trpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
        if rank == 0:
            results.put(("ok", scenario()))
        trpc.shutdown()
    except BaseException as exc:  # noqa: BLE001  (sent to the test)
        results.put(("error", repr(exc)))


def run_in_torch(scenario, tmp_path, world_size: int = 2, timeout: float = 120) -> dict:
    """`scenario()` (a module-level function) on w0 of `world_size` spawned torch RPC workers
    named w0.., over TensorPipe on loopback; its result."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_torch_worker,
                         args=(r, world_size, str(tmp_path / "init"), scenario, results),
                         daemon=True) for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        status, value = results.get(timeout=timeout)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert status == "ok", value
    return value


# Error observations: the pattern both libraries' messages match. Where shoal's sentence says
# more than torch's, the pattern is torch's words that shoal's keeps.
ERRORS = {
    "outside": r"^Current thread doesn't have a valid autograd context\. Please wrap your code",
    "retrieve_unknown": r"^Could not find autograd context with id:? 12345",
    "valid_unknown": r"^Could not find autograd context with id:? 12345",
    "release_unknown": r"^Could not find autograd context with id:? 12345",
    "retrieve_ended": r"^Could not find autograd context with id:? \d+",
    "current_ended": r"^Current thread doesn't have a valid autograd context",
    "released_current": r"^Current thread doesn't have a valid autograd context",
    "released_again": r"^Could not find autograd context with id:? \d+",
    # torch: "Already have an autograd context id for this thread."; shoal names the id.
    "nested": r"(Already have an autograd context id for this thread|This thread already has "
              r"distributed autograd context \d+; contexts do not nest)",
    "new_inside": r"(Already have an autograd context id for this thread|This thread already "
                  r"has distributed autograd context \d+; contexts do not nest)",
    "new_again": r"(Already have an autograd context id for this thread|This thread already "
                 r"has distributed autograd context \d+; contexts do not nest)",
    # A TypeError in both: torch's binding refuses the argument, shoal's ContextIdTypeError.
    "retrieve_str": r"(incompatible function arguments|context id is an int, got '1')",
    "gradients_str": r"(incompatible function arguments|context id is an int, got '1')",
}


TYPE_ERRORS = ("retrieve_str", "gradients_str")


@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(2) as pool:
        yield pool
        pool.shutdown()


def test_context_helpers_behave_as_torchs(workers, tmp_path):
    pytest.importorskip("torch")
    theirs = run_in_torch(torch_scenario, tmp_path)
    ours = workers.run(0, shoal_scenario)
    assert sorted(ours) == sorted(theirs)
    for key, pattern in ERRORS.items():
        assert ours[key] is not None and theirs[key] is not None, key
        # The exception's kind: RuntimeError, or TypeError for an id that is not an int
        # (shoal's is also a RuntimeError, being a DistAutogradError: `except TypeError`
        # catches both libraries' errors, `except RuntimeError` shoal's as well).
        kind = slice(1, 2) if key in TYPE_ERRORS else slice(0, 2)
        assert ours[key][kind] == theirs[key][kind], (key, ours[key], theirs[key])
        for side in (ours, theirs):
            assert re.search(pattern, side[key][2]), (key, side[key][2])
    same = {k: v for k, v in ours.items() if k not in ERRORS}
    assert same == {k: theirs[k] for k in same}
    # What the scenario pins down, beyond equality with torch:
    assert ours["max_id"] == (1 << 48) - 1  # w0: worker id 0 in the top 16 bits
    assert ours["send_workers"] == [0] and ours["recv_workers"] == [1]
    assert ours["known"] == [1] and ours["peer_known"] == [0]
    assert ours["pairs"] == (True, True)
    assert ours["grad"] == [4.0, 4.0]  # d/dt sum((t + 1)^2) at t = 1, exact in float64
    assert ours["debug_inside"] == {"num_autograd_contexts": 1,
                                    "num_current_backward_passes": 0}
