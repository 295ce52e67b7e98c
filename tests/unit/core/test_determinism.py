"""Determinism: core.manual_seed makes a run (init, dropout, shuffling, autocast, GradScaler)
bitwise repeatable, also across a checkpoint restart; use_deterministic_algorithms alerts."""

import hashlib
import io

import numpy as np
import pytest

from shoal import core
from shoal.core.amp import GradScaler
from shoal.core.data import DataLoader, TensorDataset
from shoal.core.ops.shape import _scatter_add

_EPOCHS = 2


def _digest(model):
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(t.numpy()).tobytes())
    return h.hexdigest()


def _build():
    model = core.nn.Sequential(core.nn.Linear(6, 16), core.nn.GELU(), core.nn.Dropout(0.2),
                               core.nn.Linear(16, 3))
    opt = core.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, GradScaler("cpu", init_scale=256.0, growth_interval=2)


def _data():
    rng = np.random.default_rng(7)  # the data set itself is fixed; its order is core's to draw
    x = rng.standard_normal((40, 6)).astype(np.float32)
    return TensorDataset(core.tensor(x), core.tensor((x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1)))


def _epoch(model, opt, scaler, loader):
    for xb, yb in loader:
        with core.autocast("cpu"):
            loss = core.nn.CrossEntropyLoss()(model(xb), yb)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _run(seed, restart_after=None):
    core.manual_seed(seed)
    model, opt, scaler = _build()
    loader = DataLoader(_data(), batch_size=8, shuffle=True)
    for epoch in range(_EPOCHS):
        if epoch == restart_after:
            # Everything a resume needs goes through core.save; fresh objects load it back.
            buf = io.BytesIO()
            core.save({"model": model.state_dict(), "opt": opt.state_dict(),
                       "scaler": scaler.state_dict(), "rng": core.get_rng_state()}, buf)
            buf.seek(0)
            core.manual_seed(seed + 1000)  # the restarted process would start elsewhere
            state = core.load(buf)
            model, opt, scaler = _build()
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            scaler.load_state_dict(state["scaler"])
            core.set_rng_state(state["rng"])
            loader = DataLoader(_data(), batch_size=8, shuffle=True)
        _epoch(model, opt, scaler, loader)
    return _digest(model)


def test_same_seed_same_bits_and_a_restart_changes_nothing():
    core.use_deterministic_algorithms(True)
    try:
        first, second = _run(3), _run(3)
        resumed = _run(3, restart_after=1)
        other = _run(4)
    finally:
        core.use_deterministic_algorithms(False)
    assert first == second == resumed
    assert other != first  # the seed matters: the test can tell runs apart


def test_deterministic_flag_raises_or_warns_for_ops_without_a_deterministic_form():
    assert not core.are_deterministic_algorithms_enabled()
    target = np.zeros(3, dtype=np.float32)
    index, values = np.array([0, 0]), np.ones(2, dtype=np.float32)
    _scatter_add(np, target, index, values)  # the host path is deterministic: never alerts
    not_numpy = object()  # stands for cupy: the alert comes before cupy is touched
    core.use_deterministic_algorithms(True)
    try:
        assert core.are_deterministic_algorithms_enabled()
        _scatter_add(np, target, index, values)
        with pytest.raises(core.NondeterministicError,
                           match=r"^scatter_add on cuda \(the backward of indexing and embedding\) "
                                 r"does not have a deterministic implementation, but you set "
                                 r"'core.use_deterministic_algorithms\(True\)'"):
            _scatter_add(not_numpy, target, index, values)
        core.use_deterministic_algorithms(True, warn_only=True)
        assert core.is_deterministic_algorithms_warn_only_enabled()
        with pytest.warns(UserWarning, match="scatter_add on cuda"):
            try:
                _scatter_add(not_numpy, target, index, values)
            except Exception:  # noqa: BLE001  (after warning it goes on to cupy: absent, or given host arrays)
                pass
    finally:
        core.use_deterministic_algorithms(False)
    assert not core.is_deterministic_algorithms_warn_only_enabled()
    np.testing.assert_array_equal(target, [4.0, 0.0, 0.0])
    with pytest.raises(TypeError, match=r"use_deterministic_algorithms: mode must be a bool, got 1\."):
        core.use_deterministic_algorithms(1)
