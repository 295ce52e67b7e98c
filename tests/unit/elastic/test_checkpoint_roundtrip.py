"""Format 2 round trips: real training states come back bit for bit, with their types, and the
metadata pickle of a real state names no global but OrderedDict."""

from __future__ import annotations

import collections
import math
import pickletools
import random
import struct

import ml_dtypes
import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn.parameter import Parameter
from shoal.elastic.checkpoint import Checkpointer, CheckpointRefused
from shoal.elastic.checkpoint_format import ALIGN, ALLOWED_GLOBALS, PREFIX_BYTES

TOKEN = "round-trip-secret"


def _model_and_optimizers(seed: int = 0):
    core.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 2))
    sgd = core.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam = core.optim.Adam(model.parameters(), lr=0.01)
    sched = core.optim.lr_scheduler.StepLR(sgd, step_size=2)
    for opt in (sgd, adam):
        opt.zero_grad()
        model(core.Tensor(np.ones((3, 4), dtype=np.float32))).sum().backward()
        opt.step()
    sched.step()
    return model, sgd, adam, sched


def real_state() -> dict:
    """What a training loop saves: model, optimizers (momentum, Adam moments), RNG states..."""
    model, sgd, adam, sched = _model_and_optimizers()
    bf16_bits = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x3F80, 0x0001], np.uint16)
    return {
        "model": model.state_dict(),
        "sgd": sgd.state_dict(),
        "adam": adam.state_dict(),
        "sched": sched.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                "pcg64": np.random.default_rng(7).bit_generator.state,
                "core": core.ops.random.get_state()},
        "bf16": bf16_bits.view(ml_dtypes.bfloat16),  # zeros, infinities, a NaN payload, tiny
        "bf16_scalar": ml_dtypes.bfloat16(1.5),
        "arrays": [np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # strided
                   np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.zeros((0, 3), np.float32),
                   np.array(3.25), np.array([1 + 2j], np.complex64), np.array([True, False]),
                   np.arange(3, dtype=">f8"), np.arange(4, dtype=np.float16)],
        "scalars": (np.float32(2.5), np.int64(-3), np.bool_(True), np.uint8(255)),
        "tensors": {"leaf": Parameter(np.ones(2, np.float32)),
                    "frozen": core.Tensor(np.full(3, 7.0), requires_grad=False)},
        "plain": {"int": 2 ** 100, "floats": [float("nan"), -0.0, float("inf"), 1e-310],
                  "str": "schön ✓", "none": None, "bytes": b"\x00\xff", "flag": False,
                  "nested": ((1, [2, (3,)]), {4: {"five": [6.0]}}), "set": {1, 2},
                  "frozen": frozenset({"a"}), "ordered": collections.OrderedDict(b=1, a=2)},
        "step": 42,
    }


def assert_identical(a, b, where="state"):
    """Equal types, equal key orders, and arrays and floats equal bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} came back as {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, core.Tensor):
        assert a.requires_grad == b.requires_grad, where
        assert_identical(a.array, b.array, f"{where}.array")
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), where
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), where
    else:
        assert a == b, where


def test_a_real_training_state_comes_back_bit_for_bit(tmp_path):
    ck = Checkpointer(tmp_path, token=TOKEN)
    state = real_state()
    ck.save(42, state)
    step, loaded = ck.load_latest()
    assert step == 42
    assert_identical(state, loaded)


def test_the_loaded_state_resumes_training_exactly(tmp_path):
    ck = Checkpointer(tmp_path, token=TOKEN)
    model, sgd, _, _ = _model_and_optimizers(seed=1)
    ck.save(1, {"model": model.state_dict(), "sgd": sgd.state_dict()})
    fresh, fresh_sgd, _, _ = _model_and_optimizers(seed=2)
    loaded = ck.load(1)
    fresh.load_state_dict(loaded["model"])
    fresh_sgd.load_state_dict(loaded["sgd"])
    x = core.Tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    for m, opt in ((model, sgd), (fresh, fresh_sgd)):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert p.array.tobytes() == q.array.tobytes(), name


def _skeleton_globals(path: str) -> set[tuple[str, str]]:
    with open(path, "rb") as f:
        raw = f.read()
    (length,) = struct.unpack("<Q", raw[8:16])
    skeleton = raw[PREFIX_BYTES + length:]  # the trailing bytes are never reached past STOP
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(skeleton):
        if isinstance(arg, str):
            strings.append(arg)
        if op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        if op.name == "STOP":
            break
    return found


def test_a_real_state_needs_no_global_beyond_the_allow_list(tmp_path):
    path = Checkpointer(tmp_path, token=TOKEN).save(1, real_state())
    assert _skeleton_globals(path) <= set(ALLOWED_GLOBALS)
    assert ("collections", "OrderedDict") in _skeleton_globals(path)


def test_arrays_are_aligned_writable_and_shared_objects_stay_shared(tmp_path):
    ck = Checkpointer(tmp_path, token=TOKEN)
    w = np.arange(10.0)
    ck.save(1, {"a": w, "b": w, "t": core.Tensor(w[:3]), "s": np.float64(1.0)})
    loaded = ck.load(1)
    assert loaded["a"] is loaded["b"]
    for array in (loaded["a"], loaded["t"].array):
        assert array.flags.writeable and array.ctypes.data % ALIGN == 0
    loaded["a"][0] = 5.0  # a loaded array is the caller's to change
    assert type(loaded["s"]) is np.float64


def test_arrays_raw_bytes_cannot_carry_load_only_when_trusted(tmp_path):
    ck = Checkpointer(tmp_path, token=TOKEN)
    ck.save(1, {"names": np.array(["a", None], dtype=object)})
    with pytest.raises(CheckpointRefused, match=r"holds numpy\.\S+, which is not on the list"):
        ck.load(1)
    trusting = Checkpointer(tmp_path, token=TOKEN, trusted=True)
    assert trusting.load(1)["names"].tolist() == ["a", None]


def test_a_state_that_cannot_be_pickled_leaves_no_file(tmp_path):
    ck = Checkpointer(tmp_path, token=TOKEN)
    with pytest.raises(Exception, match=r"The state of step 3 cannot be pickled"):
        ck.save(3, {"gen": (i for i in range(3))})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [math.pi, -0.0, float("nan")])
def test_python_floats_keep_their_bits(tmp_path, value):
    ck = Checkpointer(tmp_path, token=TOKEN)
    ck.save(1, {"x": value})
    assert struct.pack("<d", ck.load(1)["x"]) == struct.pack("<d", value)

