"""elastic.State: commit/restore in memory, checkpoints from rank 0, load after a restart,
and sync of rank 0's state to another rank over a real process group."""

from __future__ import annotations

import multiprocessing
import random
import traceback

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.elastic.checkpoint import Checkpointer
from shoal.elastic.state import State

JOIN_S = 60.0


def make(seed: int):
    core.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = core.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def train_step(model, opt):
    opt.zero_grad()
    x = core.Tensor(np.random.rand(4, 3).astype(np.float32))
    model(x).sum().backward()
    opt.step()


def params(model) -> dict:
    return {k: v.array.copy() for k, v in model.state_dict().items()}


def assert_params_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_restore_returns_to_the_last_commit_rng_included():
    model, opt = make(0)
    state = State(model=model, optimizer=opt, step=0, history=[])
    train_step(model, opt)
    state.step += 1
    state.history.append(1.0)
    state.commit()
    committed = params(model)
    draws = (random.random(), np.random.rand(), core.randn(2).array.copy())
    for _ in range(3):
        train_step(model, opt)
    state.step = 99
    state.history.append(2.0)
    state.restore()
    assert state.step == 1 and state.history == [1.0]
    assert_params_equal(params(model), committed)
    assert random.random() == draws[0] and np.random.rand() == draws[1]
    np.testing.assert_array_equal(core.randn(2).array, draws[2])
    # the optimizer's momentum came back too: one more step matches a fresh replay
    model2, opt2 = make(0)
    np.random.seed(1234)
    state.restore()
    np.random.seed(1234)
    train_step(model, opt)
    replay = State(model=model2, optimizer=opt2, step=0, history=[])
    replay._apply(state._saved)  # the committed snapshot, applied to fresh objects
    np.random.seed(1234)
    train_step(model2, opt2)
    assert_params_equal(params(model), params(model2))


def test_commit_checkpoints_from_rank_0_only_and_load_resumes(tmp_path):
    model, opt = make(0)
    ck = Checkpointer(tmp_path)
    State(model=model, optimizer=opt, step=5, checkpointer=ck, rank=1).commit()
    assert ck.steps() == []
    state = State(model=model, optimizer=opt, step=0, checkpointer=ck, rank=0)
    for _ in range(2):
        train_step(model, opt)
        state.step += 1
        state.commit()
    assert ck.steps() == [1, 2]
    saved = params(model)
    # a restarted worker: fresh objects, then load
    model2, opt2 = make(7)
    resumed = State(model=model2, optimizer=opt2, step=0, checkpointer=ck, rank=0)
    assert resumed.load() == 2
    assert resumed.step == 2
    assert_params_equal(params(model2), saved)
    assert State(model=model2, step=0, checkpointer=Checkpointer(tmp_path / "empty")).load() is None


def test_names_are_checked():
    with pytest.raises(ValueError, match=r"at least one named object"):
        State()
    with pytest.raises(ValueError, match=r"\['commit'\] clash with State's own attributes"):
        State(commit=1)
    state = State(step=0)
    with pytest.raises(AttributeError, match=r"State has no object named 'epoch'; it holds \['step'\]"):
        state.epoch  # noqa: B018  (the attribute read is what must raise)
    with pytest.raises(AttributeError, match=r"no object named 'epoch'; name every object"):
        state.epoch = 1


def _sync_rank(rank: int, port: int, queue) -> None:
    try:
        from shoal import collectives
        from shoal.collectives.store.tcp import TCPStore

        store = TCPStore("127.0.0.1", port, timeout=30)
        collectives.init_process_group("tcp", store=store, rank=rank, world_size=2, timeout=30)
        model, opt = make(seed=rank)  # different weights on each rank
        for _ in range(rank + 1):
            train_step(model, opt)
        state = State(model=model, optimizer=opt, step=10 * (rank + 1), rng=False)
        state.sync()
        queue.put((rank, None, state.step, params(model),
                   {k: v["momentum_buffer"].array.copy() for k, v in opt.state_dict()["state"].items()}))
        collectives.destroy_process_group()
        store.close()
    except BaseException:  # noqa: BLE001  (handed to the test, which reports it)
        queue.put((rank, traceback.format_exc(), None, None, None))


def test_sync_gives_every_rank_rank_0s_state():
    from shoal.collectives.store.tcp import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sync_rank, args=(r, master.port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, error, step, weights, momentum = queue.get(timeout=JOIN_S)
            assert error is None, f"rank {rank} failed:\n{error}"
            results[rank] = (step, weights, momentum)
        for r, p in enumerate(procs):
            p.join(JOIN_S)
            assert p.exitcode == 0, f"rank {r} exited with code {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        master.close()
    assert results[0][0] == results[1][0] == 10
    assert_params_equal(results[0][1], results[1][1])
    assert_params_equal(results[0][2], results[1][2])
