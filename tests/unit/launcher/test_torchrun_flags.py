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
    from shoal.launcher import rendezvous_setup

    assert rendezvous_setup.static_bind(("127.0.0.1", 29500)) == "127.0.0.1:29500"
    monkeypatch.setattr(netaddr, "is_local_address", lambda host: False)
    assert rendezvous_setup.static_bind(("shoal-train-master-0", 23456)) == "0.0.0.0:23456"


# ----------------------------------------------------------------------------- torch's rdzv keys

def _conf(conf: str, *extra: str, backend: str = "c10d", environ=None):
    endpoint = "etcd.example:2379" if backend in ("etcd", "etcd-v2") else "localhost:0"
    return parse_run([f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
                      "--rdzv-id=job", f"--rdzv-conf={conf}", *extra, SCRIPT], environ or {})


@pytest.mark.parametrize("torch_key, shoal_key", [
    ("timeout", "join_timeout"),             # torch's etcd and static rendezvous
    ("keep_alive_interval", "heartbeat_interval"),
])
def test_torch_timeouts_set_shoals_rendezvous_settings(torch_key, shoal_key):
    s = _conf(f"{torch_key}=2.5,heartbeat_timeout=9")
    assert getattr(s.rendezvous, shoal_key) == 2.5 and s.notices == ()
    assert torch_key not in s.rdzv_conf


def test_read_timeout_is_the_store_timeout():
    # torch's c10d and etcd-v2: the store's (the etcd client's) read timeout.
    assert _conf("read_timeout=7").rdzv_conf["store_timeout"] == 7
    assert _conf("read_timeout=7", backend="etcd-v2").rdzv_conf["store_timeout"] == 7


def test_keep_alive_max_attempt_makes_the_heartbeat_timeout_as_torch_does():
    # torch: a node is dead after keep_alive_interval x keep_alive_max_attempt.
    s = _conf("keep_alive_interval=2,keep_alive_max_attempt=4")
    assert (s.rendezvous.heartbeat_interval, s.rendezvous.heartbeat_timeout) == (2, 8)
    assert _conf("keep_alive_max_attempt=3").rendezvous.heartbeat_timeout == 3.0  # 1 s beats


def test_close_timeout_is_accepted_with_a_notice_and_store_type_tcp_silently():
    s = _conf("close_timeout=30,store_type=tcp")
    assert s.notices == ("--rdzv-conf close_timeout is torch's and is ignored: closing the "
                         "rendezvous is one write here, bounded by store_timeout.",)
    assert "close_timeout" not in s.rdzv_conf and "store_type" not in s.rdzv_conf


@pytest.mark.parametrize("conf, message", [
    ("store_type=file", "store_type=file (torch's FileStore rendezvous) is not supported"),
    ("store_type=redis", "key 'store_type': 'redis' is not one of tcp, file"),
    ("timeout=5,join_timeout=6", "join_timeout=6.0 disagrees with timeout=5.0 (torch's name "
                                 "for join_timeout); give one of them"),
    ("keep_alive_max_attempt=1", "keep_alive_max_attempt=1 would declare a node dead after a "
                                 "single heartbeat interval"),
    ("keep_alive_max_attempt=x", "key 'keep_alive_max_attempt': 'x' is not an integer"),
    ("read_timeout=0", "key 'read_timeout': '0' must be a finite number of seconds > 0"),
    ("protocol=https", "The store rendezvous backend takes no option 'protocol'"),
])
def test_bad_torch_conf_values_are_usage_errors(capsys, conf, message):
    assert message in _error(capsys, ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
                                      f"--rdzv-conf={conf}", SCRIPT])


@pytest.fixture
def pems(tmp_path):
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_text("not checked until connecting\n")
    return tmp_path


def test_etcd_v2_tls_spellings_and_protocol(pems):
    s = _conf(f"protocol=HTTPS,ca_cert={pems / 'ca.pem'},ssl_cert={pems / 'client.pem'},"
              f"ssl_cert_key={pems / 'client.key'}", backend="etcd-v2")
    security = s.backend_options["security"]
    assert (security.protocol, security.tls) == ("https", True)
    assert (security.cacert, security.cert, security.key) == (
        str(pems / "ca.pem"), str(pems / "client.pem"), str(pems / "client.key"))
    # protocol=https alone: TLS with the system's CAs, as torch's etcd client does.
    assert _conf("protocol=https", backend="etcd").backend_options["security"].tls
    assert not _conf("protocol=http", backend="etcd").backend_options["security"].tls
    # No protocol: shoal's rule, TLS when a CA is named.
    assert _conf(f"cacert={pems / 'ca.pem'}", backend="etcd").backend_options["security"].tls


@pytest.mark.parametrize("conf, message", [
    # Checked once, by the etcd backend's own rule (code that builds a backend meets it too).
    ("protocol=ftp", "argument --rdzv-conf/--rdzv_conf: etcd protocol='ftp' is neither http "
                     "nor https."),
    ("protocol=http,cacert={d}/ca.pem", "etcd protocol=http turns TLS off, but cacert or cert "
                                        "was given; use protocol=https"),
    ("ca_cert={d}/ca.pem,cacert={d}/client.pem", "ca_cert is torch's name for cacert); give "
                                                 "one"),
    ("ssl_cert={d}/client.pem", "etcd TLS needs both cert and key"),
    ("etcd_prefix=relative", "etcd_prefix='relative' is not an absolute key path"),
])
def test_bad_etcd_conf_values_are_usage_errors(capsys, pems, conf, message):
    err = _error(capsys, ["--rdzv-backend=etcd-v2", "--rdzv-endpoint=h:2379", "--rdzv-id=j",
                          f"--rdzv-conf={conf.format(d=pems)}", SCRIPT])
    assert message in err


def test_etcd_prefix_is_the_etcd_backends_key_root():
    s = _conf("etcd_prefix=/torchelastic/p2p/", backend="etcd-v2")
    assert s.backend_options["prefix"] == "/torchelastic/p2p"
    assert "prefix" not in _conf("ttl=10", backend="etcd").backend_options


# ----------------------------------------------------------------------------- torchrun's flags

def test_torchrun_flags_without_a_counterpart_are_accepted_with_one_notice_each():
    s = parse_run(["--logs-specs=mine", "--event-log-handler=console", "--numa-binding=node",
                   "--duplicate-stdout-filters=loss,,step,nan", "--duplicate_stderr_filters=x",
                   SCRIPT], {})
    assert len(s.notices) == 5
    assert s.notices[0].startswith("--logs-specs mine is torchrun's and is ignored")
    assert s.notices[1].startswith("--event-log-handler console is torchrun's and is ignored")
    assert s.notices[2].startswith("--numa-binding node is torchrun's and is ignored")
    assert s.notices[3].startswith("--duplicate-stdout-filters is torchrun's and is ignored")
    assert s.notices[4].startswith("--duplicate-stderr-filters is torchrun's and is ignored")
    # torchrun's defaults (and its PET_ variables) say nothing.
    assert parse_run(["--event-log-handler=null", SCRIPT], {}).notices == ()
    assert parse_run([SCRIPT], {"PET_NUMA_BINDING": "socket"}).notices[0].startswith(
        "--numa-binding socket")


def test_torchruns_comma_list_escapes_a_comma_by_doubling_it():
    from shoal.launcher.converters import comma_list

    assert comma_list("loss,,step,nan") == ("loss,step", "nan")
    assert comma_list("") == ()


def test_numa_binding_takes_torchruns_modes(capsys):
    from shoal.launcher.converters import NUMA_MODES

    import torch.numa.binding as binding  # the oracle: torchrun's own choices

    assert set(NUMA_MODES) == {mode.value for mode in binding.AffinityMode}
    assert "'near' is not one of node, socket, exclusive, core-complex" in _error(
        capsys, ["--numa-binding=near", SCRIPT])
    # Any case, as the other one-word choices (store_type, --start-method).
    assert parse_run(["--numa-binding= Socket", SCRIPT], {}).notices[0].startswith(
        "--numa-binding socket is torchrun's")


def test_virtual_local_rank_needs_a_visible_device_per_worker(capsys):
    s = parse_run(["--virtual-local-rank", "--nproc-per-node=2", SCRIPT],
                  {"CUDA_VISIBLE_DEVICES": "5,7"})
    assert s.virtual_local_rank
    assert parse_run(["--nproc-per-node=2", "--virtual-local-rank", SCRIPT], {}).virtual_local_rank
    err = _error(capsys, ["--virtual-local-rank", "--nproc-per-node=3", SCRIPT],
                 {"CUDA_VISIBLE_DEVICES": "5,7"})
    assert ("argument --virtual-local-rank/--virtual_local_rank: 3 workers need a device each, "
            "but CUDA_VISIBLE_DEVICES='5,7' lists 2") in err


def test_visible_devices_is_the_one_reading_of_cuda_visible_devices():
    # shoal run's check above and the worker-side wrapper both read it through this.
    from shoal.launcher.virtual_local_rank import visible_devices

    assert visible_devices({}) is None  # unset: every device is visible
    assert visible_devices({"CUDA_VISIBLE_DEVICES": " 5, GPU-1f,,"}) == ["5", "GPU-1f"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_every_torchrun_flag_is_accepted():
    """The oracle: torch.distributed.run's own parser. Each of its options parses here."""
    from torch.distributed.run import get_args_parser

    from shoal.launcher.flags import run_parser

    ours = {s for a in run_parser()._actions for s in a.option_strings}
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert theirs - ours == set()


# ----------------------------------------------------------------------------- the run id guard

def test_an_empty_run_id_variable_is_refused_with_etcd(capsys):
    # On Kubernetes before 1.27 the downward-API label is missing and SHOAL_RDZV_ID is "".
    for name in ("SHOAL_RDZV_ID", "PET_RDZV_ID"):
        err = _error(capsys, ["--rdzv-backend=etcd", "--rdzv-endpoint=etcd:2379", SCRIPT],
                     {name: ""})
        assert (f"argument --rdzv-id/--rdzv_id: {name} is set but empty, so this job would meet "
                "every other job on the etcd under run id 'default'") in err
        assert "batch.kubernetes.io/controller-uid" in err
    # A flag beats the empty variable; the store backend keeps its own default.
    assert _conf("ttl=10", backend="etcd", environ={"SHOAL_RDZV_ID": ""}).rdzv_id == "job"
    assert parse_run([SCRIPT], {"SHOAL_RDZV_ID": ""}).notices == ()


def test_no_run_id_with_etcd_is_warned_about():
    s = parse_run(["--rdzv-backend=etcd", "--rdzv-endpoint=etcd:2379", SCRIPT], {})
    assert s.rdzv_id == "default"
    assert s.notices == ("No run id was given (--rdzv-id or SHOAL_RDZV_ID): this job uses "
                         "'default' on etcd:2379, and so would any other job there without "
                         "one, meeting in one rendezvous. Give each job its own --rdzv-id.",)
    torchruns = parse_run(["--rdzv-backend=etcd-v2", "--rdzv-endpoint=etcd:2379", SCRIPT], {})
    assert torchruns.notices[0].startswith("No run id was given")
    assert parse_run(["--rdzv-backend=etcd", "--rdzv-endpoint=etcd:2379", "--rdzv-id=j",
                      SCRIPT], {}).notices == ()
