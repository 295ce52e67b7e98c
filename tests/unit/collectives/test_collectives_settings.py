"""The collectives layer's settings table (collectives/settings.py) as collectives.env reads it:
refusals name the variable, torch's aliases are honoured, and defaults hold when unset."""

from __future__ import annotations

import pytest

from shoal.collectives import env, settings
from shoal.core.config import SettingError


def test_a_negative_spin_is_refused_not_clamped(monkeypatch):
    monkeypatch.setenv("SHOAL_SPIN_US", "-5")
    with pytest.raises(SettingError, match=r"SHOAL_SPIN_US must be at least 0; got '-5'"):
        env.spin_seconds(2, 1e-4)


def test_a_spin_in_microseconds_becomes_seconds(monkeypatch):
    monkeypatch.setenv("SHOAL_SPIN_US", "250")
    assert env.spin_seconds(64, 1e-4) == pytest.approx(250e-6)
    monkeypatch.setenv("SHOAL_SPIN_US", "0")
    assert env.spin_seconds(1, 1e-4) == 0.0


def test_torchs_agent_store_variable_is_an_alias(monkeypatch):
    monkeypatch.delenv("SHOAL_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert env.use_agent_store() is False
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torch writes "True"
    assert env.use_agent_store() is True
    monkeypatch.setenv("SHOAL_USE_AGENT_STORE", "0")  # shoal's own variable wins
    assert env.use_agent_store() is False


def test_transport_and_hierarchy_defaults_and_refusals(monkeypatch):
    for name in ("SHOAL_LOCAL_TRANSPORT", "SHOAL_HIERARCHICAL", "SHOAL_HIER_LEADERS",
                 "SHOAL_HIER_PIPELINE"):
        monkeypatch.delenv(name, raising=False)
    assert env.local_transport() == "shm"
    assert env.hierarchical_collectives() is True
    assert env.hierarchical_leaders() is None and env.hierarchical_pipeline() is None
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", "UNIX")
    assert env.local_transport() == "unix"
    monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", "rdma")
    with pytest.raises(SettingError, match="SHOAL_LOCAL_TRANSPORT must be one of"):
        env.local_transport()
    monkeypatch.setenv("SHOAL_HIER_LEADERS", "0")
    with pytest.raises(SettingError, match="SHOAL_HIER_LEADERS must be greater than 0"):
        env.hierarchical_leaders()


def test_the_debug_level_keeps_the_upper_case_callers_expect(monkeypatch):
    monkeypatch.delenv("SHOAL_DISTRIBUTED_DEBUG", raising=False)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
    assert env.distributed_debug() == "DETAIL"


def test_every_setting_the_layer_reads_is_in_its_table():
    assert {"SHOAL_SPIN_US", "SHOAL_USE_AGENT_STORE", "TORCHELASTIC_USE_AGENT_STORE",
            "SHOAL_DISTRIBUTED_DEBUG", "TORCH_DISTRIBUTED_DEBUG"} <= settings.TABLE.names()
