"""`shoal run` and `shoal store` flags: spellings, SHOAL_<FLAG> fallbacks, and exit 2 on bad values."""

import subprocess
import sys

import pytest

from shoal.elastic.api import RendezvousSettings
from shoal.elastic.rendezvous.registry import BACKENDS
from shoal.launcher import cli
from shoal.launcher.flags import RUN_GROUPS, parse_run, parse_store, run_parser
from shoal.launcher.streams import StdSpec

SCRIPT = __file__  # any existing file will do as the training script


def _error(capsys, argv, environ=None, store=False):
    with pytest.raises(SystemExit) as info:
        (parse_store if store else parse_run)(argv, environ or {})
    assert info.value.code == 2
    return capsys.readouterr().err


def test_defaults_for_one_command_on_one_machine():
    s = parse_run([SCRIPT], {})
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node) == (1, 1, 1)
    assert s.rdzv_backend == "store" and s.rdzv_endpoints == () and s.embedded_store
    assert s.max_restarts == 3 and s.monitor_interval == 0.1
    assert s.script == SCRIPT and s.script_args == ()
    assert len(s.rdzv_id) == 12  # a random id: two embedded jobs never share a run


def test_every_flag_in_both_spellings_and_script_args_kept():
    argv = ["--nnodes", "2:4", "--nproc_per_node", "3", "--node-rank", "1",
            "--rdzv_backend", "etcd", "--rdzv-endpoint", "h1:2379,[::1]:2380", "--rdzv_id", "job.7",
            "--rdzv-conf", "join_timeout=5,last-call-timeout=0,is_host=1",
            "--max_restarts", "0", "--monitor-interval", "0.5", "--checkpoint_dir", "/tmp/ck",
            "--metrics_port", "0", "--log_dir", "/tmp/logs", "--tee", SCRIPT,
            "--nnodes", "9", "-x"]
    s = parse_run(argv, {})
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node, s.node_rank) == (2, 4, 3, 1)
    assert s.rdzv_endpoints == (("h1", 2379), ("::1", 2380)) and s.rdzv_id == "job.7"
    assert s.rdzv_conf == {"join_timeout": 5.0, "last_call_timeout": 0.0, "is_host": True}
    assert (s.max_restarts, s.monitor_interval, s.metrics_port, s.tee) == (0, 0.5, 0, StdSpec(3))
    assert s.script_args == ("--nnodes", "9", "-x")  # after the script: the script's own


def test_variables_fill_in_and_flags_beat_them():
    environ = {"SHOAL_NNODES": "1:3", "SHOAL_NPROC_PER_NODE": "2", "SHOAL_MAX_RESTARTS": "7",
               "SHOAL_TEE": "yes", "SHOAL_RDZV_ID": "from-env", "SHOAL_STANDALONE": "0"}
    s = parse_run([SCRIPT], environ)
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node, s.max_restarts, s.tee) == (1, 3, 2, 7,
                                                                                   StdSpec(3))
    assert s.rdzv_id == "from-env"
    s = parse_run(["--max-restarts", "1", "--nnodes", "2", SCRIPT], environ)
    assert (s.max_restarts, s.min_nodes, s.max_nodes) == (1, 2, 2)


@pytest.mark.parametrize("argv, names", [
    (["--nnodes", "3:1", SCRIPT], "--nnodes"),
    (["--nnodes", "0", SCRIPT], "--nnodes"),
    (["--nnodes", "a:b", SCRIPT], "--nnodes"),
    (["--nproc-per-node", "0", SCRIPT], "--nproc-per-node"),
    (["--max_restarts", "-1", SCRIPT], "--max-restarts"),
    (["--monitor-interval", "0", SCRIPT], "--monitor-interval"),
    (["--monitor-interval", "nan", SCRIPT], "--monitor-interval"),
    (["--metrics-port", "70000", SCRIPT], "--metrics-port"),
    (["--rdzv-backend", "zookeeper", SCRIPT], "--rdzv-backend"),
    (["--rdzv-endpoint", "host:notaport", SCRIPT], "--rdzv-endpoint"),
    (["--rdzv-id", "a/b", SCRIPT], "--rdzv-id"),
    (["--rdzv-conf", "colour=blue", SCRIPT], "--rdzv-conf"),
    (["--rdzv-conf", "join_timeout", SCRIPT], "--rdzv-conf"),
    (["--auth-token-file", "/no/such/file", SCRIPT], "--auth-token-file"),
    (["--standalone", "--nnodes", "2", SCRIPT], "--standalone"),
    (["--rdzv-backend", "etcd", SCRIPT], "--rdzv-endpoint"),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:0", SCRIPT], "--rdzv-endpoint"),
    (["--rdzv-endpoint", "a:1,b:2", SCRIPT], "--rdzv-endpoint"),
    (["--rdzv-conf", "join_timeout=0", SCRIPT], "--rdzv-conf"),
    (["--rdzv-conf", "heartbeat_interval=2,heartbeat_timeout=1", SCRIPT], "--rdzv-conf"),
    (["--rdzv-conf", "ttl=5", SCRIPT], "--rdzv-conf"),  # the store backend takes no ttl
    (["--bogus", SCRIPT], "--bogus"),
])
def test_bad_values_exit_2_naming_the_flag(capsys, argv, names):
    assert names in _error(capsys, argv)


def test_rendezvous_rules_are_elastic_s_own_words(capsys):
    """parse_run applies RendezvousSettings and the registry: the same sentence as in code."""
    with pytest.raises(ValueError) as info:
        RendezvousSettings(run_id="r", min_nodes=1, max_nodes=1, heartbeat_interval=2,
                           heartbeat_timeout=1)
    err = _error(capsys, ["--rdzv-conf", "heartbeat_interval=2,heartbeat_timeout=1", SCRIPT])
    assert f"argument --rdzv-conf/--rdzv_conf: {info.value}" in err
    s = parse_run(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--rdzv-id", "j",
                   "--nnodes", "1:2", "--rdzv-conf", "join_timeout=7,ttl=9", SCRIPT], {})
    assert s.rendezvous == RendezvousSettings(run_id="j", min_nodes=1, max_nodes=2,
                                              join_timeout=7.0)
    assert s.backend_options == {"ttl": 9.0}


def test_the_backend_flag_lists_the_registry_s_backends(capsys):
    def squeezed(text):  # argparse wraps lines anywhere, even inside a flag's name
        return "".join(text.split())

    help_text = squeezed(run_parser().format_help())
    for name, kind in BACKENDS.items():
        assert squeezed(f"{name}: {kind.summary}") in help_text
    assert ("choose one of ['store', 'etcd', 'c10d', 'static', 'etcd-v2']"
            in _error(capsys, ["--rdzv-backend", "zk", SCRIPT]))


def test_a_bad_variable_names_flag_and_variable(capsys):
    err = _error(capsys, [SCRIPT], {"SHOAL_NPROC_PER_NODE": "two"})
    assert "--nproc-per-node" in err and "SHOAL_NPROC_PER_NODE='two'" in err


def test_every_flag_reads_its_variable():
    # Each flag's variable is SHOAL_<FLAG>; check the table is complete and names them so.
    names = {flag.env for group in RUN_GROUPS.values() for flag in group}
    for expected in ("SHOAL_NNODES", "SHOAL_NPROC_PER_NODE", "SHOAL_NODE_RANK",
                     "SHOAL_RDZV_BACKEND", "SHOAL_RDZV_ENDPOINT", "SHOAL_RDZV_ID",
                     "SHOAL_RDZV_CONF", "SHOAL_STANDALONE", "SHOAL_MAX_RESTARTS",
                     "SHOAL_MONITOR_INTERVAL", "SHOAL_CHECKPOINT_DIR", "SHOAL_METRICS_PORT",
                     "SHOAL_LOG_DIR", "SHOAL_TEE", "SHOAL_AUTH_TOKEN_FILE"):
        assert expected in names


def test_who_hosts_the_embedded_store():
    assert parse_run(["--rdzv-endpoint", "127.0.0.1:0", "--nnodes", "2", SCRIPT], {}).embedded_store
    assert parse_run(["--rdzv-endpoint", "h:29400", "--node-rank", "0", SCRIPT], {}).embedded_store
    assert not parse_run(["--rdzv-endpoint", "h:29400", "--node-rank", "1", SCRIPT], {}).embedded_store
    assert not parse_run(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", SCRIPT],
                         {}).embedded_store


def test_store_flags(capsys):
    s = parse_store(["--host", "0.0.0.0", "--port", "0"], {})
    assert (s.host, s.port) == ("0.0.0.0", 0)
    assert parse_store([], {"SHOAL_STORE_PORT": "1234"}).port == 1234
    assert "--port" in _error(capsys, ["--port", "-5"], store=True)


def test_main_rejects_unknown_commands(capsys):
    assert cli.main(["launch"]) == 2
    assert "unknown command 'launch'" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_shoal_and_python_m_launcher_agree_on_errors():
    for argv in (["shoal"], [sys.executable, "-m", "shoal.launcher"]):
        proc = subprocess.run(argv + ["run", "--nnodes", "x", SCRIPT], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 2, proc.stderr
        assert "argument --nnodes: 'x' is not N or MIN:MAX" in proc.stderr


def test_a_missing_script_is_a_usage_error(capsys):
    err = _error(capsys, ["no/such/train.py"])
    assert "argument script: 'no/such/train.py' is not a file" in err
    assert parse_run(["-m", "pkg.train"], {}).module  # a module is looked up by python
