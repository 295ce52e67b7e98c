"""DistributedDataParallel over the real tcp backend, one spawned process per rank.

Each spawned group runs several scenarios back to back (process start-up dominates the cost)
and sends its final parameters to the parent, which compares them with one process training
on the whole batch: W = 2 and 3, plain and with no_sync accumulation, gradient_as_bucket_view,
static_graph, unused parameters and each built-in communication hook. Then uneven inputs with
and without join(), and a construction-time parameter mismatch.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback

import numpy as np
import pytest

JOIN_S = 60.0
STEPS = 3


# ------------------------------------------------------------------ shared by parent and children

def _model_cls():
    from shoal import core
    from shoal.core import nn

    class Net(nn.Module):
        def __init__(self, extra: bool = False, hidden: int = 8) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, hidden, dtype=core.float64)
            self.fc2 = nn.Linear(hidden, 3, dtype=core.float64)
            if extra:
                self.extra = nn.Linear(3, 3, dtype=core.float64)

        def forward(self, x, use_extra=False):
            out = self.fc2(self.fc1(x).tanh())
            return self.extra(out) if use_extra else out

    return Net


def make_model(seed=0, **kw):
    from shoal import core

    core.manual_seed(seed)
    return _model_cls()(**kw)


def batch(step, rank):
    from shoal.core.tensor import Tensor

    rng = np.random.default_rng([step, rank])
    return Tensor(rng.standard_normal((4, 6))), Tensor(rng.standard_normal((4, 3)))


def mse(out, y, scale=1.0):
    diff = out - y
    return (diff * diff).mean() * scale


def params_of(module):
    return [p.array.copy() for p in module.parameters()]


# Scenario name -> (DDP keyword arguments, micro-batches per step, rank using `extra`, hook name)
VARIANTS = {
    "plain": ({}, 1, None, None),
    "no_sync": ({}, 3, None, None),
    "bucket_view": ({"gradient_as_bucket_view": True}, 2, None, None),
    "static_graph": ({"static_graph": True}, 1, None, None),
    "unused": ({"find_unused_parameters": True}, 1, 1, None),
    "allreduce_hook": ({}, 1, None, "allreduce_hook"),
    "fp16_hook": ({}, 1, None, "fp16_compress_hook"),
    "bf16_hook": ({}, 1, None, "bf16_compress_hook"),
}
TOLERANCE = {"fp16_hook": 2e-3, "bf16_hook": 2e-2}


def reference_run(world, variant):
    from shoal import core

    kw, micro, extra_rank, _ = VARIANTS[variant]
    model = make_model(extra=extra_rank is not None)
    opt = core.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            for rank in range(world):
                x, y = batch(step * micro + m, rank)
                mse(model(x, use_extra=rank == extra_rank), y, 1.0 / world).backward()
        opt.step()
    return params_of(model)


# ------------------------------------------------------------------ children (module level)

def _init(rank, world, port, timeout):
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", port, timeout=30)
    return ProcessGroupTCP(store, rank, world, timeout=timeout)


def _child(rank, world, port, scenario, arg, timeout, results):
    group = None
    try:
        group = _init(rank, world, port, timeout)
        out = globals()[f"_scenario_{scenario}"](group, arg)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001  (handed to the test, which reports it)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if group is not None:
            try:
                group.shutdown()
            except BaseException:  # noqa: BLE001  (best-effort cleanup after the rank's own report)
                pass


def _scenario_variants(group, variants):
    from shoal import core
    from shoal.collectives.ddp import comm_hooks
    from shoal.collectives.ddp.ddp import DistributedDataParallel

    finals = {}
    rank = group.rank()
    for variant in variants:
        kw, micro, extra_rank, hook = VARIANTS[variant]
        model = make_model(seed=rank, extra=extra_rank is not None)  # rank 0's wins at start
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.0002, **kw)
        if hook:
            ddp.register_comm_hook(group, getattr(comm_hooks, hook))
        opt = core.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            opt.zero_grad()
            for m in range(micro):
                x, y = batch(step * micro + m, rank)
                if m < micro - 1:
                    with ddp.no_sync():
                        mse(ddp(x, use_extra=rank == extra_rank), y).backward()
                else:
                    mse(ddp(x, use_extra=rank == extra_rank), y).backward()
            opt.step()
        finals[variant] = params_of(ddp)
    return finals


def _uneven_loop(group, batches, **join_kw):
    from shoal import core
    from shoal.collectives.ddp.ddp import DistributedDataParallel

    rank = group.rank()
    ddp = DistributedDataParallel(make_model(seed=rank), process_group=group)
    opt = core.optim.SGD(ddp.parameters(), lr=0.1)

    def loop():
        for step in range(batches[rank]):
            opt.zero_grad()
            x, y = batch(step, rank)
            mse(ddp(x), y).backward()
            opt.step()

    if join_kw.pop("join", True):
        with ddp.join(**join_kw):
            loop()
    else:
        loop()
    return ddp


def _scenario_join(group, batches):
    finals = {}
    for divide in (True, False):
        ddp = _uneven_loop(group, batches, divide_by_initial_world_size=divide)
        finals[divide] = params_of(ddp)
    return finals


def _scenario_no_join(group, arg):
    """Rank 0 has 2 batches, rank 1 has 4; afterwards rank 0 meets at a barrier, idles or exits."""
    from shoal.collectives.types import CollectiveError

    after, timeout = arg
    start = time.monotonic()
    try:
        _uneven_loop(group, [2, 4], join=False)
        if group.rank() == 0:
            if after == "barrier":
                group.barrier()  # where a training script would meet the others at the end
            elif after == "idle":
                time.sleep(timeout + 2)  # alive, but calls no collective
            return ("finished", None, None, time.monotonic() - start)
    except CollectiveError as exc:
        return ("raised", type(exc).__name__, str(exc), time.monotonic() - start)
    return ("finished", None, None, time.monotonic() - start)


def _scenario_mismatch(group, _):
    from shoal.collectives.ddp.ddp import DDPError, DistributedDataParallel

    hidden = 8 if group.rank() != 1 else 9
    try:
        DistributedDataParallel(make_model(hidden=hidden), process_group=group)
    except DDPError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------ parent side

@pytest.fixture
def store():
    from shoal.collectives.store.tcp import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    yield master
    master.close()


def run_group(store, world, scenario, arg=None, timeout=20.0):
    """Spawn `world` ranks running `scenario`; return {rank: (status, payload)}."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child, args=(r, world, store.port, scenario, arg, timeout, results),
            name=f"ddp-{scenario}-rank{r}",
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + JOIN_S
    try:
        while len(got) < world:
            try:
                rank, status, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world)) - set(got))
                pytest.fail(f"ranks {missing} of scenario {scenario!r} sent no result within {JOIN_S}s")
            got[rank] = (status, payload)
    finally:
        for r, p in enumerate(procs):
            p.join(JOIN_S if p.is_alive() else 1)
            if p.is_alive():
                p.kill()
                p.join(5)
                pytest.fail(f"rank {r} of scenario {scenario!r} did not exit within {JOIN_S}s")
    for r, p in enumerate(procs):
        assert p.exitcode == 0, f"rank {r} of scenario {scenario!r} exited with code {p.exitcode}"
    return got


def ok_payloads(got):
    errors = {r: payload for r, (status, payload) in got.items() if status != "ok"}
    assert not errors, "ranks failed:\n" + "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    return {r: payload for r, (_, payload) in got.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_training_matches_one_process_on_the_whole_batch(store, world):
    out = ok_payloads(run_group(store, world, "variants", list(VARIANTS)))
    for variant in VARIANTS:
        want = reference_run(world, variant)
        tol = TOLERANCE.get(variant, 1e-6)
        for rank in range(world):
            got = out[rank][variant]
            for i, (g, w) in enumerate(zip(got, want)):
                np.testing.assert_allclose(
                    g, w, rtol=0, atol=tol, err_msg=f"{variant}: rank {rank} parameter {i}"
                )
            for i, (g, g0) in enumerate(zip(got, out[0][variant])):
                np.testing.assert_array_equal(g, g0, err_msg=f"{variant}: rank {rank} vs rank 0")


def reference_uneven(batches, divide_by_initial):
    from shoal import core

    model = make_model()
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    world = len(batches)
    for step in range(max(batches)):
        active = [r for r in range(world) if batches[r] > step]
        div = world if divide_by_initial else len(active)
        opt.zero_grad()
        for rank in active:
            x, y = batch(step, rank)
            mse(model(x), y, 1.0 / div).backward()
        opt.step()
    return params_of(model)


def test_join_with_3_5_8_batches_ends_with_identical_parameters(store):
    batches = [3, 5, 8]
    out = ok_payloads(run_group(store, 3, "join", batches))
    for divide in (True, False):
        want = reference_uneven(batches, divide)
        for rank in range(3):
            for i, (g, g0, w) in enumerate(zip(out[rank][divide], out[0][divide], want)):
                np.testing.assert_array_equal(g, g0, err_msg=f"rank {rank} parameter {i}")
                np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=f"parameter {i}")


@pytest.mark.parametrize(
    "after,kinds",
    [
        ("barrier", {"CollectiveMismatch"}),
        ("idle", {"CollectiveTimeout"}),
        ("exit", {"PeerLost", "CollectiveError", "GroupDestroyed"}),
    ],
)
def test_uneven_inputs_without_join_end_in_a_clear_error(store, after, kinds):
    timeout = 3.0
    out = ok_payloads(run_group(store, 2, "no_join", (after, timeout), timeout=timeout))
    status, kind, message, elapsed = out[1]
    assert status == "raised", "rank 1 trained on although rank 0 had stopped"
    assert kind in kinds, (kind, message)
    assert elapsed < 2 * timeout + 5, f"rank 1 needed {elapsed:.1f}s to fail"
    assert "rank 0" in message.lower() and "join()" in message, message
    if after == "barrier":
        assert out[0][0] == "raised" and out[0][1] == "CollectiveMismatch", out[0]


def test_different_parameters_are_named_on_every_rank(store):
    out = ok_payloads(run_group(store, 2, "mismatch"))
    for rank in (0, 1):
        message = out[rank]
        assert message is not None, f"rank {rank} built DDP over mismatched models"
        assert "rank 1 differs from rank 0 at parameter 0" in message
        assert "'fc1.weight' of shape (8, 6)" in message and "(9, 6)" in message
