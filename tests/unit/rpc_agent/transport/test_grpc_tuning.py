"""gRPC core's process-wide settings (rpc_agent/transport/grpc_tuning.py): importing shoal leaves
the environment alone, init_rpc applies them before grpc loads, unless the user set them, opted
out, or loaded grpc first. Each case runs in a fresh interpreter, since gRPC core reads them once
per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from shoal.rpc_agent.transport.grpc_tuning import ENV_TUNING, GRPC_ENVIRONMENT

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 60

# Prints, as JSON: the GRPC_* variables after importing shoal.rpc_agent and after init_rpc,
# whether importing changed os.environ or loaded grpc, and the tuning's log records.
_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("shoal.rpc_agent.transport.grpc_tuning").addHandler(handler)
    logging.getLogger("shoal.rpc_agent.transport.grpc_tuning").setLevel(logging.DEBUG)
    if sys.argv[1] == "grpc-first":
        import grpc
    before = dict(os.environ)
    from shoal import rpc_agent
    from shoal.collectives.store.hash import HashStore
    imported = {"environ_unchanged": dict(os.environ) == before,
                "grpc_loaded": "grpc" in sys.modules}
    names = ("GRPC_EXPERIMENTS", "GRPC_POLL_STRATEGY")
    for _ in range(2):  # a second init in the process logs nothing new
        rpc_agent.init_rpc("solo", 0, 1, rpc_agent.RpcBackendOptions(store=HashStore(),
                                                                     rpc_timeout=10))
        assert rpc_agent.rpc_sync("solo", len, ("abc",)) == 3
        rpc_agent.shutdown(timeout=10)
    from shoal.rpc_agent.transport import grpc_tuning
    print(json.dumps({**imported, "after_init": {n: os.environ.get(n) for n in names},
                      "records": records,
                      "poll_in_effect": grpc_tuning.poll_without_listener_engine()}))
""")


def _run(env: dict, mode: str = "plain") -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in GRPC_ENVIRONMENT and k != ENV_TUNING}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], env={**clean, **env},
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_shoal_leaves_the_environment_alone_and_init_rpc_applies_the_tuning():
    got = _run({})
    # Importing must not load grpc either: its C core reads the settings as it loads.
    assert got["environ_unchanged"] and not got["grpc_loaded"]
    assert got["after_init"] == GRPC_ENVIRONMENT
    assert got["records"] == []
    assert got["poll_in_effect"]  # the accept thread may leave its queue (direct_server.py)


def test_the_opt_out_leaves_them_unset():
    got = _run({ENV_TUNING: "0"})
    assert got["environ_unchanged"]
    assert got["after_init"] == {name: None for name in GRPC_ENVIRONMENT}
    assert not got["poll_in_effect"]


def test_the_users_own_values_are_kept():
    got = _run({"GRPC_POLL_STRATEGY": "epoll1"})
    assert got["after_init"] == {"GRPC_EXPERIMENTS": GRPC_ENVIRONMENT["GRPC_EXPERIMENTS"],
                                 "GRPC_POLL_STRATEGY": "epoll1"}
    assert not got["poll_in_effect"]


def test_nothing_is_set_once_grpc_is_loaded_and_a_debug_message_says_so_once():
    got = _run({}, mode="grpc-first")
    assert got["after_init"] == {name: None for name in GRPC_ENVIRONMENT}
    assert len(got["records"]) == 1
    assert "grpc was imported before init_rpc" in got["records"][0]
    assert not got["poll_in_effect"]  # what gRPC core read is not known


def test_a_bad_opt_out_value_is_named():
    done = subprocess.run(
        [sys.executable, "-c", "from shoal.rpc_agent.transport import grpc_tuning as t; t.apply()"],
        env={**os.environ, ENV_TUNING: "off"}, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert "SHOAL_RPC_GRPC_TUNING must be 0 or 1, got 'off'." in done.stderr


@pytest.mark.parametrize("set_before_import", [True, False])
def test_grpc_core_reads_its_settings_as_grpc_loads(set_before_import, tmp_path):
    """The premise of grpc_tuning, checked on the installed grpcio: an unknown poll strategy
    (with the EventEngine client off, so that iomgr polls) aborts the process when set before
    `import grpc`, and is ignored when set after it."""
    setting = ("os.environ.update(GRPC_EXPERIMENTS='-event_engine_client,"
               "-event_engine_listener', GRPC_POLL_STRATEGY='no-such-strategy')")
    lines = ["import os", setting, "import grpc"] if set_before_import else [
        "import os", "import grpc", setting]
    lines.append("grpc.insecure_channel('127.0.0.1:1').close()")
    clean = {k: v for k, v in os.environ.items() if k not in GRPC_ENVIRONMENT}
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], env=clean, cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert (done.returncode != 0) == set_before_import, done.stderr
