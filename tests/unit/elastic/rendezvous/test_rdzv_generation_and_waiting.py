"""A job's keys live under the generation of the rendezvous it joined; a forming round says
whom it waits for; the error files follow torch's format."""

from __future__ import annotations

import json
import logging
import os

import pytest

from shoal.collectives.store.hash import HashStore
from shoal.elastic.api import RendezvousSettings, RendezvousTimeoutError
from shoal.elastic.errors import (
    ERROR_FILE_ENV,
    error_document,
    read_error_file,
    record,
    write_error_file,
)
from shoal.elastic.rendezvous import RendezvousHandler
from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend


def _handler(store, node, **kw):
    settings = RendezvousSettings(**{"run_id": "job", "min_nodes": 1, "max_nodes": 1,
                                     "last_call_timeout": 0, "join_timeout": 5,
                                     "heartbeat_interval": 0.1, "heartbeat_timeout": 2, **kw})
    return RendezvousHandler(StoreRendezvousBackend(store, "job"), settings, node, store)


def test_a_new_job_under_the_same_run_id_gets_its_own_keys():
    store = HashStore(timeout=5)
    first = _handler(store, "a")
    first.next_rendezvous()
    first.job_store.add("agent/restarts", 3)
    first.set_closed()
    first.shutdown()
    # The old state is wiped (an etcd lease expired); the old job's keys are still there.
    store.delete("shoal/rdzv/job/state")
    second = _handler(store, "b")
    assert second.job_store is second.store  # before joining: nothing to scope by yet
    second.next_rendezvous()
    try:
        assert int(second.job_store.add("agent/restarts", 0)) == 0
        assert int(first.job_store.add("agent/restarts", 0)) == 3
    finally:
        second.shutdown()


def test_a_forming_round_logs_whom_it_waits_for(caplog):
    store = HashStore(timeout=5)
    lonely = _handler(store, "a", min_nodes=2, max_nodes=2, join_timeout=1.0)
    with caplog.at_level(logging.INFO, logger="shoal.elastic.rendezvous.handler"):
        with pytest.raises(RendezvousTimeoutError):
            lonely.next_rendezvous()
    lonely.shutdown()
    assert any("waiting for 1 more node(s) (have 1 of min 2: a) in round 0 of run job"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_record_writes_torchs_error_file_and_reads_back(tmp_path, monkeypatch):
    path = tmp_path / "rank_0" / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))

    @record
    def train():
        raise KeyError("no such layer")

    with pytest.raises(KeyError):
        train()
    doc = json.loads(path.read_text())
    assert doc["message"]["message"] == "KeyError: 'no such layer'"
    assert 'raise KeyError("no such layer")' in doc["message"]["extraInfo"]["py_callstack"]
    assert read_error_file(str(path)) == doc
    # torch also writes a bare string message; anything else is not an error file.
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"message": "boom"}))
    assert read_error_file(str(bare))["message"]["message"] == "boom"
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert read_error_file(str(tmp_path / "junk.json")) is None
    assert read_error_file(str(tmp_path / "absent.json")) is None


def test_a_termination_message_keeps_the_end_of_a_long_traceback(tmp_path):
    stack = "".join(f"  frame {i}\n" for i in range(2000)) + "ValueError: the real cause"
    path = tmp_path / "termination-log"
    write_error_file(str(path), error_document("ValueError: the real cause", stack, {"x": 1}),
                     limit=4096)
    text = path.read_text()
    assert len(text.encode()) <= 4096
    doc = json.loads(text)
    assert doc["message"]["extraInfo"]["py_callstack"].endswith("ValueError: the real cause")
    assert os.path.getsize(path) == len(text.encode())
