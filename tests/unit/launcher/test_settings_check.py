"""`shoal run` and `shoal store` check every layer's settings table before anything starts: a
bad SHOAL_* value is a usage error (exit status 2) naming the variable."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from shoal.core.config import SettingError
from shoal.launcher import cli
from shoal.launcher.settings import COSTLY_TABLES, check_every_layer, layer_tables


def test_every_layer_with_a_table_is_checked():
    layers = [table.layer for table in layer_tables()]
    assert layers[0] == "core" and layers[-1] == "launcher"
    assert {"collectives", "rpc_agent", "elastic"} <= set(layers)


@pytest.mark.parametrize("name, value", [("SHOAL_SPIN_US", "-5"),
                                         ("SHOAL_METRICS_LINGER_S", "soon"),
                                         ("SHOAL_RESTART_COUNT", "-1")])
def test_a_bad_value_in_any_layer_is_refused_by_name(name, value):
    with pytest.raises(SettingError, match=rf"^{name} "):
        check_every_layer({name: value})


def test_a_bad_log_level_is_left_to_the_launchers_warning():
    check_every_layer({"SHOAL_LOG_LEVEL": "loud"})


def test_shoal_run_with_a_bad_variable_exits_2_before_any_worker_starts(tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = dict(os.environ, SHOAL_SPIN_US="-5")
    proc = subprocess.run([sys.executable, "-m", "shoal.launcher", "run", str(script)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "SHOAL_SPIN_US must be at least 0; got '-5'" in proc.stderr
    assert not marker.exists()


def test_shoal_store_with_a_bad_variable_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("SHOAL_METRICS_LINGER_S", "-1")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main(["store", "--port", "0"])
    assert info.value.code == 2
    assert "SHOAL_METRICS_LINGER_S must be at least 0" in capsys.readouterr().err


def test_a_bad_rpc_variable_is_refused_by_name():
    with pytest.raises(SettingError, match=r"^SHOAL_RPC_GRPC "):
        check_every_layer({"SHOAL_RPC_GRPC": "sideways"})


def test_the_costly_tables_read_only_shoal_variables():
    # Their check is triggered by a set SHOAL_* variable that no cheaper table declares.
    for name in COSTLY_TABLES:
        table = importlib.import_module(name).TABLE
        assert all(n.startswith("SHOAL_") for n in table.names()), table.names()


CHECK_THEN_LIST = """
import json, sys
from shoal.launcher.settings import check_every_layer
check_every_layer({"SHOAL_AUTH_TOKEN": "t" * 40, "SHOAL_SPIN_US": "5"})
before = "shoal.rpc_agent" in sys.modules
check_every_layer({"SHOAL_RPC_GRPC": "public"})
print(json.dumps([before, "shoal.rpc_agent" in sys.modules]))
"""


def test_shoal_run_imports_the_rpc_layer_only_to_check_its_variables():
    # rpc_agent's package loads grpc and numpy (0.1-0.2 s on the way to the workers).
    out = subprocess.run([sys.executable, "-c", CHECK_THEN_LIST], capture_output=True,
                         text=True, timeout=60, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [False, True]
