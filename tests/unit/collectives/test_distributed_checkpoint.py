"""collectives.checkpoint in one process: round trips, refusals and the safetensors export."""

import json

import numpy as np
import pytest

from shoal import core
from shoal.collectives import checkpoint as dcp
from shoal.collectives.checkpoint.state_dict import get_state_dict, set_state_dict

TOKEN = "dcp-job-secret"


def _trained():
    core.manual_seed(3)
    model = core.nn.Sequential(core.nn.Linear(4, 6), core.nn.Linear(6, 2))
    opt = core.optim.Adam(model.parameters(), lr=0.01)
    model(core.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(tmp_path):
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "epoch": 5}, checkpoint_id=tmp_path / "ck",
             token=TOKEN)
    return model, opt


def test_a_fresh_model_and_optimizer_load_what_was_saved(tmp_path):
    model, opt = _save(tmp_path)
    core.manual_seed(4)
    fresh = core.nn.Sequential(core.nn.Linear(4, 6), core.nn.Linear(6, 2))
    fresh_opt = core.optim.Adam(fresh.parameters(), lr=0.5)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd, "epoch": 0}
    dcp.load(state, checkpoint_id=tmp_path / "ck", token=TOKEN)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    assert state["epoch"] == 5
    assert repr(fresh_opt.state_dict()) == repr(opt.state_dict())  # lr, steps and moments
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert np.array_equal(p.numpy(force=True), q.numpy(force=True)), name


def test_another_jobs_checkpoint_and_a_changed_file_are_refused(tmp_path):
    model, opt = _save(tmp_path)
    msd, osd = get_state_dict(model, opt)
    with pytest.raises(dcp.CheckpointException, match="another job"):
        dcp.load({"model": msd}, checkpoint_id=tmp_path / "ck", token="other")
    data = tmp_path / "ck" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 1
    data.write_bytes(bytes(blob))
    with pytest.raises(dcp.CheckpointException, match="does not verify"):
        dcp.load({"model": msd}, checkpoint_id=tmp_path / "ck", token=TOKEN)


def test_metadata_naming_a_file_outside_the_directory_is_refused(tmp_path):
    from shoal.collectives.checkpoint import metadata as md

    _save(tmp_path)
    key = md.derive_key(TOKEN)
    body = md.read_metadata(str(tmp_path / "ck"), key)
    entry = next(iter(body["tensors"].values()))
    entry["chunks"][0][0] = "../../etc/passwd"
    md.write_metadata(str(tmp_path / "ck"), body, key)  # signed: only the name is wrong
    name = next(iter(body["tensors"]))
    with pytest.raises(dcp.CheckpointException, match="outside the checkpoint directory"):
        dcp.load(_nested(name, core.zeros(*entry["shape"])), checkpoint_id=tmp_path / "ck",
                 token=TOKEN)


def _nested(fqn, value):
    head, _, rest = fqn.partition(".")
    return {head: {rest: value}}


def test_missing_keys_and_other_shapes_are_named(tmp_path):
    _save(tmp_path)
    with pytest.raises(dcp.CheckpointException, match="no tensor 'model.9.weight'"):
        dcp.load({"model": {"9.weight": core.zeros(2)}}, checkpoint_id=tmp_path / "ck",
                 token=TOKEN)
    with pytest.raises(dcp.CheckpointException, match=r"is \[6, 4\] in the checkpoint"):
        dcp.load({"model": {"0.weight": core.zeros(4, 6)}}, checkpoint_id=tmp_path / "ck",
                 token=TOKEN)
    with pytest.raises(dcp.CheckpointException, match="no .metadata"):
        dcp.load({}, checkpoint_id=tmp_path / "nothing", token=TOKEN)


def test_the_export_is_one_safetensors_file_torch_reads(tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    from shoal.elastic.checkpoint_safetensors import load_safetensors

    model, _ = _save(tmp_path)
    out = dcp.export_safetensors(tmp_path / "ck", tmp_path / "all.safetensors", token=TOKEN)
    tensors = st_torch.load_file(out)
    for name, p in model.named_parameters():
        assert np.array_equal(tensors[f"model.{name}"].numpy(), p.numpy(force=True)), name
    _, state = load_safetensors(out, token=TOKEN)  # signed under the same job secret
    assert state["epoch"] == 5
    assert json.loads(json.dumps(state["optim"]["param_groups"][0]["params"])) == [
        "0.weight", "0.bias", "1.weight", "1.bias"]


def test_a_data_file_larger_than_its_metadata_accounts_for_is_not_read(tmp_path):
    model, opt = _save(tmp_path)
    with open(tmp_path / "ck" / "__0_0.distcp", "ab") as f:
        f.truncate(64 << 20)  # a sparse 64 MiB tail: reading it would cost the memory
    msd, _ = get_state_dict(model, opt)
    with pytest.raises(dcp.CheckpointException, match="more than the .* its metadata accounts"):
        dcp.load({"model": msd}, checkpoint_id=tmp_path / "ck", token=TOKEN)
