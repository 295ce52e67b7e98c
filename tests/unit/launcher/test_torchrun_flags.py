"""torchrun's flags and PET_* variables as `shoal run` parses them (no processes started)."""

from __future__ import annotations

import signal

import pytest

from shoal.launcher.flags import parse_run
from shoal.launcher.streams import StdSpec, route

SCRIPT = __file__


def _error(capsys, argv, environ=None) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_run(argv, environ or {})
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_c10d_maps_to_the_store_and_hosts_where_the_endpoint_is_this_machine():
    s = parse_run(["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400", "--nnodes=2",
                   SCRIPT], {})
    assert (s.rdzv_backend, s.requested_backend, s.try_host) == ("store", "c10d", True)
    assert not s.embedded_store  # decided when the port is tried: host, or the host's client
    far = parse_run(["--rdzv-backend=c10d", "--rdzv-endpoint=192.0.2.7", "--nnodes=2", SCRIPT],
                    {})
    assert far.rdzv_endpoints == (("192.0.2.7", 29400),) and not far.try_host
    zero = parse_run(["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", SCRIPT], {})
    assert zero.embedded_store and len(zero.rdzv_id) == 12  # torchrun's "none" id: a fresh one


def test_static_is_torchruns_default_with_a_master_address():
    s = parse_run(["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=23456",
                   SCRIPT], {})
    assert (s.rdzv_backend, s.requested_backend) == ("store", "static")
    assert s.rdzv_endpoints == (("10.0.0.1", 23456),) and not s.embedded_store
    host = parse_run(["--nnodes=2", "--master-addr=10.0.0.1", SCRIPT], {})
    assert host.node_rank == 0 and host.embedded_store
    assert host.rdzv_endpoints == (("10.0.0.1", 29500),)


def test_static_refuses_an_elastic_range_and_a_rank_past_the_nodes(capsys):
    assert ("the static rendezvous needs a fixed node count, got 1:4"
            in _error(capsys, ["--rdzv-backend=static", "--nnodes=1:4", SCRIPT]))
    assert ("argument --node-rank/--node_rank: 2 is not below --nnodes 2"
            in _error(capsys, ["--rdzv-backend=static", "--nnodes=2", "--node-rank=2", SCRIPT]))


def test_pet_variables_fill_in_below_shoal_variables_and_flags():
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "10.1.2.3", "PET_MASTER_PORT": "23456"}
    s = parse_run([SCRIPT], pet)
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node, s.node_rank) == (2, 2, 3, 1)
    assert s.requested_backend == "static" and s.rdzv_endpoints == (("10.1.2.3", 23456),)
    s = parse_run(["--nproc-per-node=1", SCRIPT], {**pet, "SHOAL_NNODES": "2"})
    assert (s.nproc_per_node, s.max_nodes) == (1, 2)


def test_a_bad_pet_value_names_the_variable(capsys):
    err = _error(capsys, [SCRIPT], {"PET_NPROC_PER_NODE": "many"})
    assert "(from PET_NPROC_PER_NODE='many')" in err
    assert "'many' is not an integer (give an integer, cpu, gpu or auto)" in err


def test_stream_specs_ranks_filter_and_signals():
    s = parse_run(["-r", "3", "--tee", "0:1,1:2", "--local-ranks-filter=0,2",
                   "--signals-to-handle=SIGTERM,usr1", SCRIPT], {})
    assert s.redirects == StdSpec(3) and s.tee == StdSpec(0, {0: 1, 1: 2})
    assert s.local_ranks_filter == (0, 2) and s.signals == (signal.SIGTERM, signal.SIGUSR1)
    default = parse_run([SCRIPT], {})
    assert default.signals == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    # shoal's older bare --tee (no value before the script) still means "both streams".
    assert parse_run(["--tee", SCRIPT, "-t", "1"], {}).tee == StdSpec(3)


@pytest.mark.parametrize("argv, message", [
    (["-r", "4", SCRIPT], "'4' is not a stream spec: 0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
    (["--local-ranks-filter=a", SCRIPT], "'a' is not a comma-separated list of local ranks"),
    (["--signals-to-handle=SIGKILL", SCRIPT], "SIGKILL cannot be handled or forwarded"),
    (["--signals-to-handle=SIGNOPE", SCRIPT], "'SIGNOPE' is not a signal name"),
    (["--start-method=thread", SCRIPT], "'thread' is not one of spawn, fork, forkserver"),
    (["--no-python", "-m", "pkg"], "do not combine it with -m/--module"),
    (["--no-python", "no-such-program-here"], "is not an executable program"),
])
def test_bad_torchrun_values_are_usage_errors(capsys, argv, message):
    assert message in _error(capsys, argv)


def test_routes_follow_torchruns_redirect_and_tee_rules():
    r, t = StdSpec(3), StdSpec(0, {0: 1})
    assert route(0, redirects=r, tee=t, log_dir="/l") .console == (True, False)
    assert route(1, redirects=r, tee=t, log_dir="/l").console == (False, False)
    assert route(1, redirects=StdSpec(), tee=StdSpec(), log_dir=None).file == (False, False)
    # --log-dir alone: console as torchrun, and shoal keeps a file of every stream.
    plain = route(0, redirects=StdSpec(), tee=StdSpec(), log_dir="/l")
    assert (plain.console, plain.file) == ((True, True), (True, True))
    assert route(0, redirects=StdSpec(), tee=StdSpec(), log_dir=None,
                 ranks_filter=(1,)).console == (False, False)
    assert route(0, redirects=StdSpec(2), tee=StdSpec(), log_dir=None).file == (False, True)


def test_shutdown_timeout_is_the_grace_period():
    assert parse_run(["--grace-period=3", "--shutdown-timeout=9", SCRIPT], {}).grace_period == 9
    assert parse_run(["--grace-period=3", SCRIPT], {}).grace_period == 3


def test_a_static_master_listens_on_every_interface_when_its_name_is_not_local_yet(monkeypatch):
    from shoal.core import netaddr
    from shoal.launcher import cli

    assert cli._static_bind(("127.0.0.1", 29500)) == "127.0.0.1:29500"
    monkeypatch.setattr(netaddr, "is_local_address", lambda host: False)
    assert cli._static_bind(("shoal-train-master-0", 23456)) == "0.0.0.0:23456"
