"""core.save / core.load: round trips of what torch users save, and files that must be refused."""

import collections
import io
import json
import struct

import numpy as np
import pytest

from shoal import core
from shoal.core.serialization import MAGIC, SerializationError


def _roundtrip(obj):
    buf = io.BytesIO()
    core.save(obj, buf)
    buf.seek(0)
    return core.load(buf)


def test_model_and_optimizer_state_dicts_round_trip_through_a_path(tmp_path):
    model = core.nn.Sequential(core.nn.Linear(3, 4), core.nn.LayerNorm(4), core.nn.Linear(4, 2))
    opt = core.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(core.randn(5, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    core.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, path)
    loaded = core.load(path)
    assert loaded["epoch"] == 3
    assert isinstance(loaded["model"], collections.OrderedDict)
    assert list(loaded["model"]) == list(model.state_dict())
    fresh = core.nn.Sequential(core.nn.Linear(3, 4), core.nn.LayerNorm(4), core.nn.Linear(4, 2))
    fresh.load_state_dict(loaded["model"])
    x = core.randn(2, 3)
    assert core.equal(fresh(x), model(x))
    fresh_opt = core.optim.Adam(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(loaded["optim"])
    assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.99)
    assert repr(fresh_opt.state_dict()) == repr(opt.state_dict())


def test_values_keep_their_types_bits_and_identity():
    t = core.randn(2, 3)
    obj = {
        "none": None, "flag": True, "n": -(2**70), "x": float("nan"), "inf": float("-inf"),
        "pi": 0.1, "s": "ü", "raw": b"\x00\xff", 7: "int key", (1, 2): ["tuple key"],
        "nested": [(1, [2.5, {"deep": None}])],
        "bf16": core.tensor([1.5, -2.0], dtype=core.bfloat16),
        "u8": core.tensor([1, 255], dtype=core.uint8), "i8": core.tensor([-128, 7], dtype=core.int8),
        "mask": core.tensor([True, False]), "empty": core.zeros(0, 4),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3), "np_scalar": np.float64(2.5),
        "same_twice": [t, t], "param": core.nn.Parameter(core.ones(2)),
        "dtype": core.float16, "device": core.device("cpu"),
        "t_view": core.arange(10)[2:8:2],
    }
    back = _roundtrip(obj)
    assert set(back) == set(obj)
    for key in ("none", "flag", "n", "inf", "pi", "s", "raw", 7, (1, 2), "nested", "dtype", "device"):
        assert back[key] == obj[key] and type(back[key]) is type(obj[key]), key
    assert np.isnan(back["x"])
    for key in ("bf16", "u8", "i8", "mask", "empty", "t_view"):
        assert back[key].dtype == obj[key].dtype and core.equal(back[key], obj[key]), key
    np.testing.assert_array_equal(back["np"], obj["np"])
    assert back["np"].dtype == np.int32 and back["np"].flags.writeable
    assert back["np_scalar"] == 2.5 and isinstance(back["np_scalar"], np.float64)
    assert back["same_twice"][0] is back["same_twice"][1]
    assert isinstance(back["param"], core.nn.Parameter) and back["param"].requires_grad
    assert not back["same_twice"][0].requires_grad


def test_map_location_moves_and_renames_devices():
    back = core.load(_bytes({"w": core.ones(2)}), map_location="cpu")
    assert back["w"].device == core.device("cpu")
    back = core.load(_bytes({"w": core.ones(2)}), map_location={"cuda:0": "cpu"})
    assert back["w"].device == core.device("cpu")


def _bytes(obj):
    buf = io.BytesIO()
    core.save(obj, buf)
    buf.seek(0)
    return buf


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_save_refuses_objects_it_cannot_represent_without_code():
    with pytest.raises(SerializationError, match=r"core.save: cannot save an object of type "
                                                 r"test_serialization._Evil at the saved "
                                                 r"object\['model'\]\[1\]"):
        core.save({"model": [1, _Evil()]}, io.BytesIO())
    with pytest.raises(SerializationError, match=r"save a model's state_dict\(\), not the model"):
        core.save(core.nn.Linear(2, 2), io.BytesIO())
    with pytest.raises(SerializationError, match="cannot save an array of dtype object"):
        core.save(np.array([None]), io.BytesIO())


def _craft(tree, arrays=(), body=b""):
    header = json.dumps({"format": 1, "tree": tree, "arrays": list(arrays)}).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    return io.BytesIO(head + b"\0" * (-len(head) % 64) + body)


@pytest.mark.parametrize(
    "blob, why",
    [
        (io.BytesIO(b"PK\x03\x04 torch zip"), r"does not start with b'SHOALPT1' \(it looks like a "
                                              r"torch.save zip file\)"),
        (io.BytesIO(b"\x80\x04\x95 a pickle"), r"does not start with b'SHOALPT1'\.$"),
        (io.BytesIO(MAGIC + struct.pack("<Q", 10**6) + b"{}"), "its header claims 1000000 bytes"),
        (_craft(["global", "os", "system"]), "unknown node tag 'global'"),
        (_craft(["int", "1"]), "an int node holds str"),
        (_craft(["ndarray", 0], [{"dtype": "float32", "shape": [1000], "offset": 0,
                                  "nbytes": 4000}], b"\0" * 64), "array 0 .* lies outside the file"),
        (_craft(["ndarray", 0], [{"dtype": "object", "shape": [1], "offset": 0, "nbytes": 8}],
                b"\0" * 64), r"its header is damaged \(DTypeError"),
        (_craft(["ndarray", 3]), "array index 3 is not in its table"),
        (_craft(["list", [["list", []]] * 2 + [["tuple", [7]]]]), "a node is int, not a tagged list"),
    ],
)
def test_load_refuses_files_that_are_not_shoal_data(blob, why):
    with pytest.raises(SerializationError, match=r"core.load: the file object is not a readable "
                                                 r"shoal file: .*" + why):
        core.load(blob)


def test_load_has_no_unsafe_mode():
    with pytest.raises(ValueError, match=r"core.load\(weights_only=False\): shoal's format holds "
                                         "no pickled objects"):
        core.load(_bytes([1]), weights_only=False)


def test_torch_reads_the_same_values_we_wrote():
    torch = pytest.importorskip("torch")
    model = core.nn.Linear(3, 2)
    tmodel = torch.nn.Linear(3, 2)
    state = core.load(_bytes(model.state_dict()))
    tmodel.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in state.items()})
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(tmodel(torch.from_numpy(x)).detach().numpy(),
                               model(core.tensor(x)).numpy(force=True), rtol=1e-6)
