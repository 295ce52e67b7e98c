"""Distributed autograd across three spawned workers: gradients equal one process's, finite
differences through a graph spanning three workers (A -> B -> C -> A), a tensor sent twice,
remote() results and RRef.backward, @async_execution callees, rpc_async from the context's
thread, each worker's part running once per pass, cleanup on every worker, the bad-input
errors and the metrics (read from the Prometheus exposition)."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core, rpc_agent
from shoal.rpc_agent import dist_autograd
from shoal.rpc_agent.functions import async_execution
from tests.support.rpc_workers import RpcWorkers

# Each worker's own parameters (module globals live once per spawned process).
_PARAMS: dict = {}
RNG_SEED = 7


def _values(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def init_params() -> None:
    """Every worker makes its parameter `w` (4x4) deterministically from its rank."""
    rank = rpc_agent.get_worker_info().id
    _PARAMS["w"] = core.Tensor(_values(100 + rank, (4, 4)), requires_grad=True)


def live_contexts(timeout: float = 10.0) -> int:
    """This worker's live contexts once the releases in flight have landed (contexts end on
    peers asynchronously, as in torch); polls the count, bounded by `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    while dist_autograd.live_context_count() and time.monotonic() < deadline:
        time.sleep(0.005)
    return dist_autograd.live_context_count()


# ----------------------------------------------------------------------------- stages

def stage(x):
    """tanh(x @ w) with this worker's w."""
    return (x @ _PARAMS["w"]).tanh()


def stage_then(x, nxt):
    """This worker's stage, then the next worker's stage (nested call)."""
    return rpc_agent.rpc_sync(nxt, stage_then_last, (stage(x),))


def stage_then_last(x):
    """Stage on B, then C's stage, which calls back into A's stage: A -> B -> C -> A."""
    y = stage(x)
    return rpc_agent.rpc_sync("w2", stage_calling_back, (y,))


def stage_calling_back(x):
    return rpc_agent.rpc_sync("w0", stage, (stage(x),)) * 2.0


@async_execution
def stage_async(x):
    """An @async_execution callee that calls on: its result comes through a Future."""
    return rpc_agent.rpc_async("w2", stage, (stage(x),))


def local_stage(x, w):
    return (x @ w).tanh()


# ----------------------------------------------------------------------------- tasks on w0

def _x() -> core.Tensor:
    return core.Tensor(_values(1, (3, 4)), requires_grad=True)


def chain_loss(x):
    """loss(x) through w0 -> w1 -> w2 -> w0 -> w2 ... : x, w0 and (remotely) w1, w2."""
    y = stage(x)
    z = rpc_agent.rpc_sync("w1", stage_then_last, (y,))
    return (z * z).sum()


def task_chain_grads():
    x = _x()
    with dist_autograd.context() as cid:
        loss = chain_loss(x)
        dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
        local = {"x": grads[x].array.copy(), "w0": grads[_PARAMS["w"]].array.copy()}
        remote = {f"w{r}": rpc_agent.rpc_sync(f"w{r}", my_grad, (cid,)) for r in (1, 2)}
        untouched = x.grad is None and _PARAMS["w"].grad is None
    return float(loss.item()), local, remote, untouched


def my_grad(cid):
    return dist_autograd.get_gradients(cid)[_PARAMS["w"]].array.copy()


def task_chain_loss_value(w_values: dict, x_value):
    """The chain's loss for given parameter values (finite differences), no autograd."""
    return float(_chain_loss_numpy(w_values, x_value))


def _chain_loss_numpy(ws: dict, x):
    y = np.tanh(x @ ws["w0"])
    y = np.tanh(y @ ws["w1"])
    y = np.tanh(y @ ws["w2"])
    y = np.tanh(y @ ws["w0"]) * 2.0
    return (y * y).sum()


def task_twice_and_remote():
    """A tensor sent twice, a remote() result fetched with to_here, summed."""
    x = _x()
    with dist_autograd.context() as cid:
        a = rpc_agent.rpc_sync("w1", stage, (x,))
        b = rpc_agent.rpc_sync("w1", stage, (x,))
        r = rpc_agent.remote("w2", stage, (x,))
        loss = (a * b).sum() + r.to_here().sum()
        dist_autograd.backward(cid, [loss])
        gx = dist_autograd.get_gradients(cid)[x].array.copy()
        g1 = rpc_agent.rpc_sync("w1", my_grad, (cid,))
        g2 = rpc_agent.rpc_sync("w2", my_grad, (cid,))
    return gx, g1, g2


def task_rref_backward():
    """remote() keeps a loss on w1; RRef.backward runs the pass from there."""
    x = _x()
    with dist_autograd.context() as cid:
        loss_rref = rpc_agent.remote("w1", remote_loss, (x,))
        loss_rref.backward(cid)
        gx = dist_autograd.get_gradients(cid)[x].array.copy()
        g1 = rpc_agent.rpc_sync("w1", my_grad, (cid,))
    return gx, g1


def remote_loss(x):
    return stage(x).sum()


def task_async_execution():
    x = _x()
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", stage_async, (x,))
        dist_autograd.backward(cid, [y.sum()])
        gx = dist_autograd.get_gradients(cid)[x].array.copy()
        g1 = rpc_agent.rpc_sync("w1", my_grad, (cid,))
        g2 = rpc_agent.rpc_sync("w2", my_grad, (cid,))
    return gx, g1, g2


def task_unused_remote_and_retain():
    """A call whose result backward never reaches, and two passes with retain_graph."""
    x = _x()
    with dist_autograd.context() as cid:
        rpc_agent.rpc_sync("w2", stage, (x,))  # unused: its send gets "no gradient"
        y = rpc_agent.rpc_sync("w1", stage, (x,))
        loss = y.sum()
        dist_autograd.backward(cid, [loss], retain_graph=True)
        once = dist_autograd.get_gradients(cid)[x].array.copy()
        dist_autograd.backward(cid, [loss])
        twice = dist_autograd.get_gradients(cid)[x].array.copy()
        w2_grads = rpc_agent.rpc_sync("w2", grad_count, (cid,))
    return once, twice, w2_grads


def task_rpc_async_from_the_context_thread():
    """rpc_async from the thread that holds the context, waited for there."""
    x = _x()
    with dist_autograd.context() as cid:
        fut = rpc_agent.rpc_async("w1", stage, (x,))
        y = fut.wait()
        dist_autograd.backward(cid, [(y * y).sum()])
        gx = dist_autograd.get_gradients(cid)[x].array.copy()
        g1 = rpc_agent.rpc_sync("w1", my_grad, (cid,))
    return gx, g1


_HOOK_CALLS: list = []


def fan_out_stage(x):
    """w1's stage, whose output goes to w2 twice: its node has two send functions, so its
    gradient arrives in two parts; a counting hook records each time the node runs."""
    def count(g):
        _HOOK_CALLS.append(g.shape)

    y = stage(x)
    y.register_hook(count)
    a = rpc_agent.rpc_sync("w2", stage, (y,))
    b = rpc_agent.rpc_sync("w2", stage, (y,))
    return a * b


def hook_calls() -> int:
    return len(_HOOK_CALLS)


def task_each_part_runs_once():
    """Two backward passes (retain_graph on the first) through fan_out_stage; w1's hook
    count after each."""
    x = _x()
    counts = []
    with dist_autograd.context() as cid:
        start = rpc_agent.rpc_sync("w1", hook_calls)
        z = rpc_agent.rpc_sync("w1", fan_out_stage, (x,))
        loss = z.sum()
        for retain in (True, False):
            dist_autograd.backward(cid, [loss], retain_graph=retain)
            counts.append(rpc_agent.rpc_sync("w1", hook_calls) - start)
        gx = dist_autograd.get_gradients(cid)[x].array.copy()
        g1 = rpc_agent.rpc_sync("w1", my_grad, (cid,))
        g2 = rpc_agent.rpc_sync("w2", my_grad, (cid,))
    return counts, gx, g1, g2


def as_float(x):
    """Takes a tensor that requires grad and answers a plain float: its worker records a recv
    function but sends nothing back, so backward reaches it only by a begin message."""
    return float(x.array.sum())


def task_recv_only_peer():
    """w2 only received x: its answer to the begin carries x's "no gradient" back to w0."""
    x = _x()
    with dist_autograd.context() as cid:
        rpc_agent.rpc_sync("w2", as_float, (x,))
        y = rpc_agent.rpc_sync("w1", stage, (x,))
        dist_autograd.backward(cid, [y.sum()])
        gx = dist_autograd.get_gradients(cid)[x].array.copy()
    return gx


def grad_count(cid):
    return len(dist_autograd.get_gradients(cid))


def task_ping_pong():
    """w0 -> w1 -> w0 -> w1 -> w0: each gradient w1 owes w0 rides on the answer to w0's message,
    so w1 sends no message of its own. Returns the gradients and the batch counters' moves."""
    x = _x()
    before = gradient_batches()
    with dist_autograd.context() as cid:
        y = stage(rpc_agent.rpc_sync("w1", stage, (x,)))
        z = rpc_agent.rpc_sync("w1", stage, (y,))
        dist_autograd.backward(cid, [(z * z).sum()])
        gx = dist_autograd.get_gradients(cid)[x].array.copy()
        g0 = dist_autograd.get_gradients(cid)[_PARAMS["w"]].array.copy()
        g1 = rpc_agent.rpc_sync("w1", my_grad, (cid,))
    after = gradient_batches()
    moved = {how: after[how] - before[how] for how in after}
    return gx, g0, g1, moved


def has_gradient(cid) -> bool:
    ctx_grads = dist_autograd.get_gradients(cid)
    return _PARAMS["w"] in ctx_grads


def task_gradients_leave_before_a_later_node_runs():
    """A node that runs after a received tensor's gradient is finished (here a hook that
    waits, as DDP's finalize waits for its all-reduce) must not hold that gradient back: w1
    has it while the hook still runs."""
    import time

    x = _x()
    seen = []
    with dist_autograd.context() as cid:
        a = x * 2.0  # older than the call: its node runs after the received tensor is done

        def wait_for_w1(g):
            deadline = time.monotonic() + 5.0
            got = False
            while not got and time.monotonic() < deadline:
                got = rpc_agent.rpc_sync("w1", has_gradient, (cid,))
                time.sleep(0.005)
            seen.append(got)

        a.register_hook(wait_for_w1)
        r = rpc_agent.rpc_sync("w1", stage, (_x(),))
        dist_autograd.backward(cid, [(a.sum() + r.sum())])
    return seen


def task_gradient_of_a_parameter():
    """What get_gradients holds for an nn.Parameter leaf: its type and requires_grad."""
    p = core.nn.Parameter(core.Tensor(_values(5, (4, 4))))
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", stage, (_x() @ p,))
        dist_autograd.backward(cid, [y.sum()])
        g = dist_autograd.get_gradients(cid)[p]
    return type(g).__name__, g.requires_grad, p.grad is None


def gradient_batches() -> dict:
    """This worker's gradient batch counters, and w1's (w0 asks it)."""
    from shoal.rpc_agent import metrics

    mine = {"w0 " + how: c._value.get() for how, c in
            (("message", metrics.DIST_BATCHES_AS_MESSAGE),
             ("on_answer", metrics.DIST_BATCHES_ON_ANSWER))}
    if rpc_agent.get_worker_info().name == "w0":
        theirs = rpc_agent.rpc_sync("w1", gradient_batches)
        mine.update({k.replace("w0", "w1", 1): v for k, v in theirs.items()})
    return mine


def task_errors():
    """Each bad input's error type and message."""
    out = {}
    x = _x()

    def catch(key, fn):
        try:
            fn()
        except dist_autograd.DistAutogradError as exc:
            out[key] = str(exc)

    catch("unknown", lambda: dist_autograd.backward(12345, [x.sum()]))
    catch("bad_id", lambda: dist_autograd.get_gradients("1"))
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", stage, (x,))
        catch("not_scalar", lambda: dist_autograd.backward(cid, [y]))
        catch("no_grad", lambda: dist_autograd.backward(cid, [core.Tensor(np.ones(()))]))
        catch("not_list", lambda: dist_autograd.backward(cid, []))
        catch("nested", lambda: dist_autograd.context().__enter__())
        dist_autograd.backward(cid, [y.sum()])
        catch("twice", lambda: dist_autograd.backward(cid, [y.sum()]))
    catch("ended", lambda: dist_autograd.get_gradients(cid))
    catch("ended_backward", lambda: dist_autograd.backward(cid, [y.sum()]))
    out["cid"] = cid
    return out


_METRIC_NAMES = ("shoal_rpc_dist_autograd_contexts", "shoal_rpc_dist_autograd_backward_total",
                 "shoal_rpc_dist_autograd_backward_seconds")


def scrape() -> tuple[str, dict]:
    """This worker's Prometheus exposition (the default registry, which the node agent serves
    beside the workers' files) and its distributed autograd samples, read back from the text."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("shoal_rpc_dist_autograd_") and \
                    not sample.name.endswith("_created"):
                key = sample.name + "".join(f"{{{k}={v}}}" for k, v in
                                            sorted(sample.labels.items()) if k != "le")
                if "le" not in sample.labels:
                    samples[key] = sample.value
    return text, samples


def refusing_stage(x):
    """A stage whose backward fails on this worker."""
    def refuse(g):
        raise ValueError("this stage refuses its backward")
    y = stage(x)
    y.register_hook(refuse)
    return y


def task_metrics():
    """The samples before a pass, after a good one (with its wall time) and after a failed
    one, the live-context gauge inside a context, and the exposition's text."""
    import time

    _, before = scrape()
    x = _x()
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", stage, (x,))
        _, inside = scrape()
        start = time.perf_counter()
        dist_autograd.backward(cid, [y.sum()])
        wall = time.perf_counter() - start
    _, after_ok = scrape()
    failure = None
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", refusing_stage, (x,))
        try:
            dist_autograd.backward(cid, [y.sum()])
        except Exception as exc:  # noqa: BLE001  (its text is part of the result)
            failure = f"{type(exc).__name__}: {exc}"
    text, after_error = scrape()
    return before, inside, after_ok, after_error, wall, failure, text


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(3) as pool:
        pool.run_all(init_params)
        yield pool
        pool.shutdown()


def _ws() -> dict:
    return {f"w{r}": _values(100 + r, (4, 4)) for r in range(3)}


def _local_chain():
    """The same model in one process, with core's local autograd: the reference."""
    ws = {k: core.Tensor(v, requires_grad=True) for k, v in _ws().items()}
    x = _x()
    y = local_stage(x, ws["w0"])
    y = local_stage(y, ws["w1"])
    y = local_stage(y, ws["w2"])
    y = local_stage(y, ws["w0"]) * 2.0
    loss = (y * y).sum()
    loss.backward()
    return float(loss.item()), x.grad.array, {k: t.grad.array for k, t in ws.items()}


def _assert_all_released(workers):
    assert workers.run_all(live_contexts) == [0, 0, 0]


def test_gradients_through_a_three_worker_cycle_equal_one_process(workers):
    loss, local, remote, untouched = workers.run(0, task_chain_grads)
    ref_loss, ref_x, ref_w = _local_chain()
    assert loss == pytest.approx(ref_loss, abs=1e-12)
    np.testing.assert_allclose(local["x"], ref_x, rtol=0, atol=1e-12)
    np.testing.assert_allclose(local["w0"], ref_w["w0"], rtol=0, atol=1e-12)
    for key in ("w1", "w2"):
        np.testing.assert_allclose(remote[key], ref_w[key], rtol=0, atol=1e-12)
    assert untouched, "distributed backward wrote into .grad"
    _assert_all_released(workers)


def test_finite_differences_through_three_workers(workers):
    _, local, remote, _ = workers.run(0, task_chain_grads)
    grads = {"w0": local["w0"], **remote}
    ws, x = _ws(), _values(1, (3, 4))
    eps = 1e-6
    rng = np.random.default_rng(3)
    for key in ("w0", "w1", "w2"):
        for _ in range(3):
            i, j = rng.integers(0, 4, size=2)
            plus = {k: v.copy() for k, v in ws.items()}
            minus = {k: v.copy() for k, v in ws.items()}
            plus[key][i, j] += eps
            minus[key][i, j] -= eps
            fd = (_chain_loss_numpy(plus, x) - _chain_loss_numpy(minus, x)) / (2 * eps)
            assert grads[key][i, j] == pytest.approx(fd, rel=1e-6, abs=1e-8), (key, i, j)


def test_a_tensor_sent_twice_and_a_remote_result(workers):
    gx, g1, g2 = workers.run(0, task_twice_and_remote)
    ws = {k: core.Tensor(v, requires_grad=True) for k, v in _ws().items()}
    x = _x()
    a = local_stage(x, ws["w1"])
    b = local_stage(x, ws["w1"])
    loss = (a * b).sum() + local_stage(x, ws["w2"]).sum()
    loss.backward()
    np.testing.assert_allclose(gx, x.grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g1, ws["w1"].grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g2, ws["w2"].grad.array, rtol=0, atol=1e-12)
    _assert_all_released(workers)


def test_rref_backward_starts_on_the_owner(workers):
    gx, g1 = workers.run(0, task_rref_backward)
    w1 = core.Tensor(_values(101, (4, 4)), requires_grad=True)
    x = _x()
    local_stage(x, w1).sum().backward()
    np.testing.assert_allclose(gx, x.grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g1, w1.grad.array, rtol=0, atol=1e-12)
    _assert_all_released(workers)


def test_calls_from_async_execution_functions(workers):
    gx, g1, g2 = workers.run(0, task_async_execution)
    ws = {k: core.Tensor(v, requires_grad=True) for k, v in _ws().items()}
    x = _x()
    local_stage(local_stage(x, ws["w1"]), ws["w2"]).sum().backward()
    np.testing.assert_allclose(gx, x.grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g1, ws["w1"].grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g2, ws["w2"].grad.array, rtol=0, atol=1e-12)
    _assert_all_released(workers)


def test_rpc_async_from_the_contexts_own_thread(workers):
    gx, g1 = workers.run(0, task_rpc_async_from_the_context_thread)
    w1 = core.Tensor(_values(101, (4, 4)), requires_grad=True)
    x = _x()
    y = local_stage(x, w1)
    (y * y).sum().backward()
    np.testing.assert_allclose(gx, x.grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g1, w1.grad.array, rtol=0, atol=1e-12)
    _assert_all_released(workers)


def test_each_workers_part_of_the_graph_runs_once_per_pass(workers):
    # w1's node gets its gradient from two sends to w2; FAST mode counts both before running
    # it, so its hook runs once per pass, not once per arriving part.
    counts, gx, g1, g2 = workers.run(0, task_each_part_runs_once)
    assert counts == [1, 2]
    ws = {k: core.Tensor(v, requires_grad=True) for k, v in _ws().items()}
    x = _x()
    y = local_stage(x, ws["w1"])
    loss = (local_stage(y, ws["w2"]) * local_stage(y, ws["w2"])).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    np.testing.assert_allclose(gx, x.grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g1, ws["w1"].grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g2, ws["w2"].grad.array, rtol=0, atol=1e-12)
    _assert_all_released(workers)


def test_gradients_owed_to_the_sender_ride_on_its_answer(workers):
    gx, g0, g1, moved = workers.run(0, task_ping_pong)
    ws = {k: core.Tensor(v, requires_grad=True) for k, v in _ws().items()}
    x = _x()
    z = local_stage(local_stage(local_stage(x, ws["w1"]), ws["w0"]), ws["w1"])
    (z * z).sum().backward()
    np.testing.assert_allclose(gx, x.grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g0, ws["w0"].grad.array, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g1, ws["w1"].grad.array, rtol=0, atol=1e-12)
    # Two round trips: w0's two messages, each answered with the gradients w1 owed w0.
    assert moved == {"w0 message": 2, "w0 on_answer": 0, "w1 message": 0, "w1 on_answer": 2}
    _assert_all_released(workers)


def test_gradients_leave_before_a_later_node_runs(workers):
    assert workers.run(0, task_gradients_leave_before_a_later_node_runs) == [True]
    _assert_all_released(workers)


def test_a_parameters_gradient_is_a_plain_tensor_needing_no_grad(workers):
    # as torch's get_gradients (and local autograd's .grad): not a Parameter, no grad needed
    assert workers.run(0, task_gradient_of_a_parameter) == ("Tensor", False, True)


def test_unreached_calls_complete_and_retain_graph_accumulates(workers):
    once, twice, w2_grads = workers.run(0, task_unused_remote_and_retain)
    np.testing.assert_allclose(twice, 2 * once, rtol=0, atol=1e-12)
    assert w2_grads == 0
    _assert_all_released(workers)


def test_a_peer_that_only_received_answers_its_begin_with_no_gradient(workers):
    gx = workers.run(0, task_recv_only_peer)
    w1 = core.Tensor(_values(101, (4, 4)), requires_grad=True)
    x = _x()
    local_stage(x, w1).sum().backward()
    np.testing.assert_allclose(gx, x.grad.array, rtol=0, atol=1e-12)
    _assert_all_released(workers)


def test_bad_input_errors_name_the_context(workers):
    out = workers.run(0, task_errors)
    cid = out["cid"]
    assert out["unknown"].startswith(
        "Could not find autograd context with id: 12345 on worker 'w0'")
    assert out["bad_id"] == "A distributed autograd context id is an int, got '1'."
    assert out["not_scalar"] == (
        f"backward(context {cid}): root 0 has shape (3, 4); distributed backward starts from "
        "scalars only.")
    assert out["no_grad"] == (
        f"backward(context {cid}): root 0 does not require grad, so there is nothing to "
        "differentiate.")
    assert out["not_list"] == (
        f"backward(context {cid}): roots must be a non-empty list of Tensors, got [].")
    assert out["nested"] == (
        f"Already have an autograd context id for this thread (context {cid}); contexts do "
        "not nest.")
    assert out["twice"].startswith(
        f"Distributed autograd context {cid} already ran a backward pass without "
        "retain_graph=True on worker 'w0'")
    assert out["ended"].startswith(f"Could not find autograd context with id: {cid} on worker")
    assert out["ended_backward"] == (
        f"Could not find autograd context with id: {cid} on worker 'w0': it was never created "
        "here or has already ended (use it inside its `with dist_autograd.context()` block).")
    assert issubclass(dist_autograd.DistAutogradError, rpc_agent.RpcError)
    _assert_all_released(workers)


def test_metrics_count_contexts_and_passes(workers):
    before, inside, after_ok, after_error, wall, failure, text = workers.run(0, task_metrics)
    contexts = "shoal_rpc_dist_autograd_contexts"
    ok = "shoal_rpc_dist_autograd_backward_total{status=ok}"
    error = "shoal_rpc_dist_autograd_backward_total{status=error}"
    count = "shoal_rpc_dist_autograd_backward_seconds_count"
    seconds = "shoal_rpc_dist_autograd_backward_seconds_sum"

    def moved(a, b):
        return {k: b[k] - a[k] for k in (ok, error, count)}

    assert inside[contexts] == 1 and after_error[contexts] == 0
    # The good pass: one more ok, one more duration observed, of no more than its wall time.
    assert moved(before, after_ok) == {ok: 1, error: 0, count: 1}
    assert 0 < after_ok[seconds] - before[seconds] <= wall
    # The failed pass: one more error, and no duration observed.
    assert failure is not None and "this stage refuses its backward" in failure, failure
    assert moved(after_ok, after_error) == {ok: 0, error: 1, count: 0}
    assert after_error[seconds] == after_ok[seconds]
    for name, kind in zip(_METRIC_NAMES, ("gauge", "counter", "histogram")):
        assert f"# TYPE {name} {kind}" in text, name
    _assert_all_released(workers)


# ----------------------------------------------------------------------------- faults

def slow_stage(x, marker):
    """A stage whose backward announces itself (a file) and blocks until the test kills this
    worker."""
    def hang(g):
        import pathlib
        import time

        pathlib.Path(marker).touch()
        time.sleep(60)
        return g
    y = stage(x)
    y.register_hook(hang)
    return y


def task_backward_with_dying_peer(marker):
    import time

    x = _x()
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", slow_stage, (x, marker))
        start = time.monotonic()
        try:
            dist_autograd.backward(cid, [y.sum()])
        except dist_autograd.DistAutogradError as exc:
            return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_worker_killed_mid_backward_fails_the_pass_naming_it(tmp_path):
    import time

    marker = tmp_path / "w1-in-backward"
    with RpcWorkers(2, rpc_timeout=20) as pool:
        pool.run_all(init_params)
        task = pool.submit(0, task_backward_with_dying_peer, str(marker))
        deadline = time.monotonic() + 30
        while not marker.exists():  # w1's backward has reached the blocking hook
            assert time.monotonic() < deadline, "w1 never reached its backward hook"
            time.sleep(0.01)
        pool.kill(1)
        message, seconds = pool.result(task, timeout=30)
        assert message is not None and "'w1'" in message, message
        assert seconds < 20
        assert pool.run(0, live_contexts) == 0
        pool.close()


# ----------------------------------------------------------------------------- torch oracle

_TORCH: dict = {}


def torch_stage(x):
    return (x @ _TORCH["w"]).tanh()


def torch_stage_then_last(x):
    import torch.distributed.rpc as trpc

    return trpc.rpc_sync("w2", torch_stage_calling_back, (torch_stage(x),))


def torch_stage_calling_back(x):
    import torch.distributed.rpc as trpc

    return trpc.rpc_sync("w0", torch_stage, (torch_stage(x),)) * 2.0


def torch_my_grad(cid):
    import torch.distributed.autograd as tdist

    return tdist.get_gradients(cid)[_TORCH["w"]].numpy().copy()


def _torch_worker(rank: int, init_file: str, results) -> None:
    import os

    os.environ.update(TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed.autograd as tdist
    import torch.distributed.rpc as trpc

    try:
        torch.set_num_threads(1)
        _TORCH["w"] = torch.tensor(_values(100 + rank, (4, 4)), requires_grad=True)
        opts = trpc.TensorPipeRpcBackendOptions(
            init_method=f"file://{init_file}", rpc_timeout=30,
            _transports=["uv"], _channels=["basic"],
        )
        trpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
        if rank == 0:
            x = torch.tensor(_values(1, (3, 4)), requires_grad=True)
            with tdist.context() as cid:
                y = torch_stage(x)
                z = trpc.rpc_sync("w1", torch_stage_then_last, (y,))
                loss = (z * z).sum()
                tdist.backward(cid, [loss])
                grads = tdist.get_gradients(cid)
                out = {"x": grads[x].numpy().copy(), "w0": grads[_TORCH["w"]].numpy().copy()}
                for r in (1, 2):
                    out[f"w{r}"] = trpc.rpc_sync(f"w{r}", torch_my_grad, (cid,))
            results.put(("ok", out))
        trpc.shutdown()
    except BaseException as exc:  # noqa: BLE001  (sent to the test)
        results.put(("error", repr(exc)))


def test_torch_dist_autograd_over_tensorpipe_gives_the_same_gradients(workers, tmp_path):
    pytest.importorskip("torch")
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_torch_worker, args=(r, str(tmp_path / "init"), results),
                         daemon=True) for r in range(3)]
    for proc in procs:
        proc.start()
    try:
        status, torch_grads = results.get(timeout=90)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert status == "ok", torch_grads
    _, local, remote, _ = workers.run(0, task_chain_grads)
    ours = {**local, **remote}
    for key in ("x", "w0", "w1", "w2"):
        np.testing.assert_allclose(ours[key], torch_grads[key], rtol=0, atol=1e-12,
                                   err_msg=key)


def relay(x):
    """w1 passes x on to w2: the context on w1 involves w2."""
    return rpc_agent.rpc_sync("w2", stage, (x,))


def task_context_across_a_dying_worker(pool_kill_marker):
    import pathlib
    import time

    x = _x()
    with dist_autograd.context() as cid:
        y = rpc_agent.rpc_sync("w1", relay, (x,))
        pathlib.Path(pool_kill_marker).touch()  # the test kills w2 now
        with rpc_agent.context.context_id(None):  # queries outside the context
            deadline = time.monotonic() + 20
            while rpc_agent.rpc_sync("w1", live_contexts, (0.0,)) and \
                    time.monotonic() < deadline:
                time.sleep(0.01)
            w1_live = rpc_agent.rpc_sync("w1", live_contexts, (0.0,))
        try:
            dist_autograd.backward(cid, [y.sum()])
            message = None
        except Exception as exc:  # noqa: BLE001  (its type and text are the result)
            message = f"{type(exc).__name__}: {exc}"
    return cid, w1_live, message


def test_a_dead_worker_ends_the_contexts_that_involve_it(tmp_path):
    import time

    marker = tmp_path / "kill-w2"
    with RpcWorkers(3, rpc_timeout=20) as pool:
        pool.run_all(init_params)
        task = pool.submit(0, task_context_across_a_dying_worker, str(marker))
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "w0 never finished its forward"
            time.sleep(0.01)
        pool.kill(2)
        cid, w1_live, message = pool.result(task, timeout=40)
        assert w1_live == 0  # w1 ended its context when w2's stream died
        assert message is not None and message.startswith("DistAutogradError: "), message
        assert f"context {cid}" in message and "'w2'" in message, message
        assert pool.run(0, live_contexts) == 0
        assert pool.run(1, live_contexts) == 0
        pool.close()
