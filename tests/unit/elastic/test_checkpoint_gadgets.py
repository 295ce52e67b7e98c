"""Crafted checkpoints: code-running pickle gadgets, foreign and tampered files, bad tables.

Each gadget file carries a VALID MAC made with the job's own key, so that what stops it is the
exact allow-list, not the MAC. The dotted routes are the ones format 1's loader admitted (any
class under a module named core.* or ml_dtypes.*, with protocol 4+ walking the dots).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import pickle
import re
import struct

import numpy as np
import pytest

from shoal.elastic.api import CheckpointError
from shoal.elastic.checkpoint import Checkpointer, CheckpointCorrupt
from shoal.elastic.checkpoint_format import (
    END,
    MAGIC,
    CheckpointRefused,
    CheckpointUnauthenticated,
    derive_key,
)

TOKEN = "job-secret-for-crafted-files"
KEY = derive_key(TOKEN.encode())


def _str(text: str) -> bytes:
    raw = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def call_global(module: str, name: str, *args) -> bytes:
    """A protocol-5 pickle of {"x": module.name(*args)}, naming the global with STACK_GLOBAL."""
    packed_args = pickle.dumps(args, protocol=2)[2:-1]  # no PROTO, no STOP, no frames
    return (pickle.PROTO + b"\x05" + pickle.EMPTY_DICT + _str("x") + _str(module) + _str(name)
            + pickle.STACK_GLOBAL + packed_args + pickle.REDUCE + pickle.SETITEM + pickle.STOP)


def craft(ck: Checkpointer, step: int, skeleton: bytes, key: bytes = KEY, arrays=(),
          data: bytes = b"", header_changes: dict = None) -> None:
    """Write step's format-2 file by hand: header, skeleton, raw array bytes, HMAC, end marker."""
    header = {"format": 2, "step": step, "payload_bytes": len(skeleton) + len(data),
              "skeleton": {"offset": 0, "nbytes": len(skeleton)}, "arrays": list(arrays)}
    header.update(header_changes or {})
    encoded = json.dumps(header).encode()
    body = MAGIC + struct.pack("<Q", len(encoded)) + encoded + skeleton + data
    with open(ck.path(step), "wb") as f:
        f.write(body + hmac.new(key, body, hashlib.sha256).digest() + END)


@pytest.fixture
def ck(tmp_path):
    return Checkpointer(tmp_path / "ck", token=TOKEN)


# ----------------------------------------------------------------------------- gadgets

# (module, name) as format 1 admitted them, and the same class named directly.
GADGETS = {
    "ctypes.CDLL": [("shoal.core.tensor", "np._core._internal.ctypes.CDLL"), ("ctypes", "CDLL")],
    "threading.Thread": [("shoal.core.auth", "threading.Thread"), ("threading", "Thread")],
    "functools.partial": [("ml_dtypes._finfo", "np._utils.functools.partial"),
                          ("functools", "partial")],
    "builtins.type": [("shoal.core.tensor", "Tensor.__class__"), ("builtins", "type")],
    "io.FileIO": [("shoal.core.tensor", "np.f2py.subprocess.io.FileIO"), ("io", "FileIO")],
    "logging.FileHandler": [("shoal.core.auth", "logging.FileHandler"), ("logging", "FileHandler")],
}
ROUTES = [pytest.param(m, n, id=f"{target}-via-{m}") for target, routes in GADGETS.items()
          for m, n in routes]


def _args_for(name: str, tmp_path) -> tuple:
    """Arguments that would do harm if the call ran: files opened for writing, a library."""
    target = name.rsplit(".", 1)[-1]
    if target in ("FileIO", "FileHandler"):
        return (str(tmp_path / "victim.txt"), "w")
    if target == "CDLL":
        return ("libc.so.6",)
    if target == "type":
        return ("Evil", (), {})
    return ()


@pytest.mark.parametrize("module, name", ROUTES)
def test_each_gadget_with_a_valid_mac_is_refused_by_the_allow_list(ck, tmp_path, module, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    craft(ck, 7, call_global(module, name, *_args_for(name, tmp_path)))
    kind = "the dotted global " if "." in name else ""
    with pytest.raises(CheckpointRefused, match=rf"Checkpoint '.*ckpt-000000000007\.shoal' holds "
                                                rf"{kind}{re.escape(f'{module}.{name}')}"):
        ck.load(7)
    assert victim.read_text() == "precious"  # FileIO/FileHandler(.., "w") would have emptied it


def test_a_file_handler_gadget_never_creates_its_file(ck, tmp_path):
    marker = tmp_path / "marker.log"
    craft(ck, 3, call_global("shoal.core.auth", "logging.FileHandler", str(marker)))
    with pytest.raises(CheckpointRefused, match=r"dotted global shoal\.core\.auth\.logging\.FileHandler"):
        ck.load(3)
    assert not marker.exists()


def test_a_dotted_name_is_refused_even_when_its_parts_are_allowed(ck, tmp_path):
    # ("collections", "OrderedDict") is allowed; walking from it is not.
    craft(ck, 1, call_global("collections", "OrderedDict.fromkeys", ["a"]))
    with pytest.raises(CheckpointRefused,
                       match=r"dotted global collections\.OrderedDict\.fromkeys"):
        ck.load(1)


def test_allow_admits_an_exact_extra_global_but_never_a_dotted_one(tmp_path):
    ck = Checkpointer(tmp_path, token=TOKEN, allow=["builtins.sorted", "shoal.core.auth.threading"])
    craft(ck, 1, call_global("builtins", "sorted", [3, 1, 2]))
    assert ck.load(1) == {"x": [1, 2, 3]}
    craft(ck, 1, call_global("shoal.core.auth", "threading.Thread"))
    with pytest.raises(CheckpointRefused, match=r"dotted global shoal\.core\.auth\.threading\.Thread"):
        ck.load(1)


# ----------------------------------------------------------------------------- the MAC

def test_a_checkpoint_of_another_job_is_refused_naming_the_file(tmp_path):
    Checkpointer(tmp_path, token="job-a").save(5, {"w": np.arange(4.0)})
    with pytest.raises(CheckpointUnauthenticated,
                       match=r"Checkpoint '.*ckpt-000000000005\.shoal' .* was not written by "
                             r"this job \(its MAC does not match this job's secret\)\. Resuming "
                             r"across separate launches needs the same SHOAL_AUTH_TOKEN"):
        Checkpointer(tmp_path, token="job-b").load(5)
    assert Checkpointer(tmp_path, token="job-a").load(5)["w"].tolist() == [0, 1, 2, 3]


def test_the_secret_comes_from_shoal_auth_token_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_AUTH_TOKEN", "first-launch")
    Checkpointer(tmp_path).save(1, {"step": 1})
    monkeypatch.setenv("SHOAL_AUTH_TOKEN", "second-launch")
    with pytest.raises(CheckpointUnauthenticated, match=r"not written by this job"):
        Checkpointer(tmp_path).load(1)
    assert Checkpointer(tmp_path, token="first-launch").load(1) == {"step": 1}


def test_a_gadget_under_a_wrong_key_is_refused_by_the_mac_before_parsing(ck, tmp_path):
    marker = tmp_path / "marker.log"
    craft(ck, 2, call_global("logging", "FileHandler", str(marker)), key=derive_key(b"attacker"))
    with pytest.raises(CheckpointUnauthenticated, match=r"its MAC does not match"):
        ck.load(2)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["magic+8", "header", "skeleton", "array", "mac"])
def test_a_tampered_byte_is_refused(ck, where):
    path = ck.save(4, {"w": np.arange(100.0), "step": 4})
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    header_end = 16 + struct.unpack("<Q", raw[8:16])[0]
    at = {"magic+8": 9, "header": raw.index(b'"step": 4') + 8, "skeleton": header_end + 3,
          "array": len(raw) - 40 - 8, "mac": len(raw) - 20}[where]
    raw[at] ^= 0x01
    with open(path, "wb") as f:
        f.write(raw)
    if where == "magic+8":
        # The header's length is checked against the file's size before the MAC (so that a
        # huge file is not allocated first): damage there reads as a bad header.
        with pytest.raises(CheckpointCorrupt, match=r"ckpt-000000000004\.shoal' has an unread"):
            ck.load(4)
        return
    with pytest.raises(CheckpointUnauthenticated,
                       match=r"ckpt-000000000004\.shoal' fails its sha256 check"):
        ck.load(4)


def test_load_latest_falls_back_past_crafted_and_foreign_files(ck, tmp_path, caplog):
    marker = tmp_path / "marker.log"
    ck.save(1, {"step": 1, "w": np.ones(3)})
    craft(ck, 2, call_global("shoal.core.auth", "logging.FileHandler", str(marker)))
    Checkpointer(ck.directory, token="another-job").save(3, {"step": 3})
    with caplog.at_level(logging.WARNING, logger="shoal.elastic.checkpoint"):
        step, state = ck.load_latest()
    assert step == 1 and state["step"] == 1 and not marker.exists()
    messages = [r.getMessage() for r in caplog.records]
    assert any("Skipping checkpoint of step 3" in m and "ckpt-000000000003.shoal" in m
               and "not written by this job" in m for m in messages), messages
    assert any("Skipping checkpoint of step 2" in m and "ckpt-000000000002.shoal" in m
               and "logging.FileHandler" in m for m in messages), messages


def test_when_every_file_is_crafted_loading_fails_loudly(ck):
    craft(ck, 9, call_global("builtins", "eval", "1"))
    with pytest.raises(CheckpointError, match=r"None of the 1 checkpoints .* is readable: .*"
                                              r"holds builtins\.eval, which is not on the list"):
        ck.load_latest()


# ----------------------------------------------------------------------------- framing and table

def test_a_format_1_file_is_refused_with_a_message_that_says_why(ck):
    with open(ck.path(1), "wb") as f:
        f.write(b"SHOALCK1" + pickle.dumps({"step": 1}) + b"{}" + bytes(8) + b"SHOALEND")
    with pytest.raises(CheckpointCorrupt, match=r"old format 1 \(SHOALCK1\), which this version "
                                                r"refuses: format 1 was not authenticated"):
        ck.load(1)


SKELETON = pickle.dumps({"w": None}, protocol=5)
GOOD_ENTRY = {"kind": "array", "dtype": "<f8", "shape": [2], "offset": len(SKELETON),
              "nbytes": 16}


@pytest.mark.parametrize("change, message", [
    ({"dtype": "|O8"}, r"unknown array dtype '\|O8'"),
    ({"dtype": "<U4"}, r"unknown array dtype '<U4'"),
    ({"shape": [3]}, r"array of shape \[3\] and dtype float64 in 16 bytes"),
    ({"shape": [-2]}, r"bad array dimension: -2"),
    ({"offset": 10 ** 6}, r"bad region offset: 1000000"),
    ({"nbytes": 17}, r"bad region length: 17"),
    ({"kind": "tensor"}, r"bad array-table entry"),
    ({"kind": "scalar"}, r"bad array-table entry"),
])
def test_a_bad_array_table_entry_with_a_valid_mac_is_corrupt(ck, change, message):
    craft(ck, 1, SKELETON,
          arrays=[{**GOOD_ENTRY, **change}], data=np.arange(2.0).tobytes())
    with pytest.raises(CheckpointCorrupt, match=message):
        ck.load(1)


def test_the_hand_made_file_loads_when_its_table_is_right(ck):
    # {"w": <table entry 0>}, the way the writer refers to arrays.
    skeleton = (pickle.PROTO + b"\x05" + pickle.EMPTY_DICT + _str("w") + pickle.BININT1 + b"\x00"
                + pickle.BINPERSID + pickle.SETITEM + pickle.STOP)
    craft(ck, 1, skeleton,
          arrays=[{**GOOD_ENTRY, "offset": len(skeleton)}], data=np.arange(2.0).tobytes())
    assert ck.load(1)["w"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("pid", [1, -1, "0"])
def test_a_persistent_id_outside_the_table_is_corrupt(ck, pid):
    skeleton = (pickle.PROTO + b"\x05" + pickle.dumps(pid, protocol=2)[2:-1] + pickle.BINPERSID
                + pickle.STOP)
    craft(ck, 1, skeleton)
    with pytest.raises(CheckpointCorrupt, match=r"refers to array .*, but its table holds 0"):
        ck.load(1)


@pytest.mark.parametrize("change, message", [
    ({"step": 2}, r"says it is step 2, not 1"),
    ({"format": 3}, r"header of an unknown format"),
    ({"payload_bytes": 0}, r"bad payload length: 0"),
    ({"arrays": None}, r"no skeleton or array table"),
    ({"skeleton": [0, 5]}, r"no skeleton or array table"),
])
def test_a_bad_header_with_a_valid_mac_is_corrupt(ck, change, message):
    craft(ck, 1, SKELETON, header_changes=change)
    with pytest.raises(CheckpointCorrupt, match=message):
        ck.load(1)
