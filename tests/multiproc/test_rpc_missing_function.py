"""A function missing on the callee (issue 24), side by side with torch's TensorPipe agent: the
caller gets a RuntimeError from rpc_sync/rpc_async (and an AttributeError from a remote()'s
to_here when the module lacks the name), promptly, and the agent keeps serving. shoal's message
names the function, its module and the callee worker."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import socket
import sys
import tempfile
import time

import pytest

from tests.support.rpc_workers import RpcWorkers

CASES = ("sync", "async", "remote")
MISSING_NAME = "defined_only_on_the_caller"


def _defined_only_here():
    """A function the callee lacks: a module it imports, given the name only in this process."""
    def fn(x):
        return x + 1

    fn.__name__ = fn.__qualname__ = MISSING_NAME
    fn.__module__ = __name__
    setattr(sys.modules[__name__], MISSING_NAME, fn)
    return fn


def _from_a_module_only_here():
    """A function from a module only this process can import (its folder is on no other path)."""
    folder = tempfile.mkdtemp()
    name = f"only_on_caller_{os.getpid()}"
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write("def helper(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.helper


def _outcomes(api, cases) -> list:
    """(case, kind, exception's class names, message, seconds) for each (function maker, call)."""
    out = []
    for make, kind in cases:
        fn = make()
        t0 = time.monotonic()
        try:
            if kind == "sync":
                api.rpc_sync(1, fn, (1,))
            elif kind == "async":
                api.rpc_async(1, fn, (1,)).wait()
            else:
                api.remote(1, fn, (1,)).to_here()
            out.append((make.__name__, kind, ["no error"], "", time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001  (the outcome is what is compared)
            out.append((make.__name__, kind, [c.__name__ for c in type(exc).__mro__], str(exc),
                        time.monotonic() - t0))
    return out


# torch's remote() of a function whose module the callee cannot import never answers (it runs
# into the RPC timeout), so that one case is shoal's alone.
TORCH_CASES = [(_defined_only_here, k) for k in CASES] + [(_from_a_module_only_here, "sync"),
                                                           (_from_a_module_only_here, "async")]
SHOAL_CASES = TORCH_CASES + [(_from_a_module_only_here, "remote")]


def echo(x):
    return x


def _shoal_caller():
    from shoal import rpc_agent
    from shoal.core import profiler

    outcomes = _outcomes(rpc_agent, [(make, kind) for make, kind in SHOAL_CASES])
    # under the profiler the function travels wrapped; the error still names it
    with profiler.profile():
        profiled = _outcomes(rpc_agent, [(_defined_only_here, "sync")])
    # an argument the callee cannot unpickle is not a missing function: its own error stays
    try:
        rpc_agent.rpc_sync("w1", echo, (_defined_only_here(),))
        argument = "no error"
    except Exception as exc:  # noqa: BLE001
        argument = type(exc).__name__
    return outcomes + profiled, argument, rpc_agent.rpc_sync("w1", max, (1, 2))


def _torch_worker(rank: int, port: int, results) -> None:
    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=30,
                                           _transports=["uv"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        outcomes = _outcomes(rpc, TORCH_CASES)
        results.put((outcomes, rpc.rpc_sync("worker1", max, (1, 2))))
    rpc.shutdown()


def _torch_outcomes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_torch_worker, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=90)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def shoal_outcomes():
    with RpcWorkers(2) as pool:
        yield pool.run(0, _shoal_caller)
        pool.shutdown()


def test_shoal_names_the_function_its_module_and_the_callee_and_keeps_serving(shoal_outcomes):
    outcomes, argument, after = shoal_outcomes
    assert after == 2
    assert argument == "AttributeError"
    assert len(outcomes) == len(SHOAL_CASES) + 1
    for make, kind, classes, message, seconds in outcomes:
        assert seconds < 10, (make, kind, seconds)
        assert "RpcFunctionNotFound" in classes and "RuntimeError" in classes, (make, kind)
        assert "worker 'w1' (id 1)" in message
        if make == "_defined_only_here":
            assert "AttributeError" in classes
            assert message.startswith(
                f"RPC function {__name__}.{MISSING_NAME} cannot be found on worker 'w1' (id 1): "
                f"its module '{__name__}' has no '{MISSING_NAME}' there"), message
        else:
            assert "ModuleNotFoundError" in classes
            module = f"only_on_caller_{message.split('only_on_caller_')[1].split('.')[0]}"
            assert message.startswith(
                f"RPC function {module}.helper cannot be found on worker 'w1' (id 1): its module "
                f"'{module}' cannot be imported there"), message


def test_the_caller_can_catch_it_as_it_catches_torchs(shoal_outcomes):
    pytest.importorskip("torch.distributed.rpc")
    torch_outcomes, torch_after = _torch_outcomes()
    assert torch_after == 2  # torch's agent keeps serving too
    shoal = {(make, kind): classes for make, kind, classes, _, _ in shoal_outcomes[0]}
    for make, kind, classes, message, _ in torch_outcomes:
        # every class torch raises (RuntimeError, or AttributeError from to_here) catches shoal's
        assert classes[0] != "no error", (make, kind)
        assert set(classes) <= set(shoal[(make, kind)]), (make, kind, classes, shoal[(make, kind)])
        missing = MISSING_NAME if make == "_defined_only_here" else "only_on_caller_"
        assert missing in message  # torch names the missing attribute or module, as shoal does
