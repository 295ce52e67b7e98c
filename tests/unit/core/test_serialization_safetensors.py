"""core.save / core.load in safetensors: torch reads what shoal writes and shoal reads torch's."""

import collections
import io
import json
import struct

import numpy as np
import pytest

from shoal import core
from shoal.core import serialization
from shoal.core.serialization import SerializationError, UnauthenticatedFile

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def _model():
    return core.nn.Sequential(core.nn.Linear(3, 5), core.nn.LayerNorm(5), core.nn.Linear(5, 2))


def _torch_model():
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5),
                               torch.nn.Linear(5, 2))


def test_a_shoal_state_dict_loads_in_torch_through_safetensors(tmp_path):
    model = _model()
    path = tmp_path / "model.safetensors"
    core.save(model.state_dict(), path)
    loaded = st_torch.load_file(str(path))
    tmodel = _torch_model()
    tmodel.load_state_dict(loaded)  # strict: the same keys, shapes and dtypes as torch's
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    # Same weights, same float32 ops: the two libraries' kernels may order sums differently,
    # so a few ulps of the outputs (about 1 in magnitude) are allowed.
    np.testing.assert_allclose(tmodel(torch.from_numpy(x)).detach().numpy(),
                               model(core.tensor(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_torch_state_dict_loads_into_a_shoal_model(tmp_path):
    tmodel = _torch_model()
    path = tmp_path / "torch.safetensors"
    st_torch.save_file(tmodel.state_dict(), str(path))
    model = _model()
    model.load_state_dict(core.load(path))
    for name, value in model.state_dict().items():
        assert np.array_equal(value.numpy(), tmodel.state_dict()[name].numpy()), name


def test_format_argument_and_sniffing_choose_safetensors_for_file_objects():
    buf = io.BytesIO()
    sd = {"w": core.ones(2, 2, dtype=core.bfloat16), "b": core.arange(3)}
    core.save(sd, buf, format="safetensors")
    assert buf.getvalue()[8:9] == b"{"
    loaded = core.load(io.BytesIO(buf.getvalue()))  # found by its framing, no hint given
    assert loaded["w"].dtype == core.bfloat16 and loaded["b"].dtype == core.int64
    assert st_torch.load(buf.getvalue())["w"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="format must be one of"):
        core.save(sd, io.BytesIO(), format="pickle")


def test_nested_states_keep_their_shape_and_parameters_their_kind(tmp_path):
    model = _model()
    opt = core.optim.Adam(model.parameters(), lr=1e-3)
    model(core.randn(2, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3,
             "p": core.nn.Parameter(core.ones(2)), "tag": ("a", 1.5, None)}
    path = tmp_path / "state.safetensors"
    core.save(state, path)
    loaded = core.load(path)
    assert loaded["epoch"] == 3 and loaded["tag"] == ("a", 1.5, None)
    assert isinstance(loaded["model"], collections.OrderedDict)
    assert isinstance(loaded["p"], core.nn.Parameter) and loaded["p"].requires_grad
    assert repr(loaded["optim"]) == repr(opt.state_dict())
    # torch sees the tensors under their dotted paths.
    assert "model.0.weight" in st_torch.load_file(str(path))


def test_complex128_is_refused_with_the_dtypes_safetensors_holds():
    with pytest.raises(SerializationError, match="safetensors has no dtype for complex128"):
        core.save({"z": core.zeros(2, dtype=core.complex128)}, io.BytesIO(), format="safetensors")


def test_damaged_headers_and_trees_are_refused(tmp_path):
    with pytest.raises(SerializationError, match="header claims"):
        core.load(io.BytesIO(struct.pack("<Q", 999) + b"{}"), format="safetensors")
    arrays, metadata = serialization.to_safetensors({"a": core.ones(2)})
    metadata[serialization.TREE_KEY] = json.dumps(["call", "os.system", "id"])
    blob = serialization.safetensors_bytes(arrays, metadata)
    with pytest.raises(SerializationError, match="unknown node tag 'call'"):
        core.load(io.BytesIO(blob))
    metadata[serialization.TREE_KEY] = json.dumps(["tensor", 7, False, "cpu"])
    with pytest.raises(SerializationError, match="array index 7"):
        core.load(io.BytesIO(serialization.safetensors_bytes(arrays, metadata)))


def test_signed_files_verify_under_their_key_only():
    blob = serialization.signed_safetensors({"w": core.ones(3)}, b"k" * 32, {"shoal_step": "4"})
    state, metadata = serialization.verified_safetensors(blob, "f", b"k" * 32)
    assert metadata["shoal_step"] == "4" and core.equal(state["w"], core.ones(3))
    with pytest.raises(UnauthenticatedFile, match="another job"):
        serialization.verified_safetensors(blob, "f", b"x" * 32)
    arrays, metadata = serialization.read_safetensors(blob, "f")
    arrays["w"] = arrays["w"] + 1  # changed content under the old MAC
    forged = serialization.safetensors_bytes(arrays, metadata)
    with pytest.raises(UnauthenticatedFile, match="changed since"):
        serialization.verified_safetensors(forged, "f", b"k" * 32)
    unsigned = serialization.safetensors_bytes(*serialization.to_safetensors({"w": core.ones(1)}))
    with pytest.raises(UnauthenticatedFile, match="carries no"):
        serialization.verified_safetensors(unsigned, "f", b"k" * 32)
