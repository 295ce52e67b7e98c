"""Suite-wide settings: a fixed auth token for spawned ranks, no stray BLAS threads, and which
tests are `slow` (left out of the fast loop, `python -m pytest -m "not slow"`)."""

import os

# Every process the suite starts inherits these, so ranks agree on the secret and numpy's BLAS
# does not oversubscribe the two cores CI has.
os.environ.setdefault("SHOAL_AUTH_TOKEN", "shoal-test-suite-token")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from pathlib import Path

import pytest

# The message every listener or dial gives when it refuses the development token off loopback.
DEVELOPMENT_TOKEN_RULE = (
    r"which is not a loopback address, and no secret is set: set SHOAL_AUTH_TOKEN")

_TESTS = Path(__file__).resolve().parent

# Folders whose every test starts processes, ranks, servers or devices: all of them are slow.
SLOW_FOLDERS = ("multiproc", "integration", "security", "gpu", "torch_ports")

# Tests of the fast folders (tests/unit, tests/contracts) that take more than a second even on
# an idle machine, keyed "path under tests/::name" (a file, a test function or a class's test;
# every parametrization of it): most wait out a timeout or a grace period on purpose, which is
# the behaviour they check. Each value says why it is slow. A test that runs ranks and takes
# seconds belongs in tests/multiproc instead.
SLOW_TESTS = {
    "unit/torch_bridge/test_bridge_deferral.py::test_a_wait_with_a_timeout_on_a_parked_op_ends_within_it":
        "waits out a 0.5 s timeout on purpose, with two groups' meshes formed",
    "unit/collectives/ddp/test_powersgd_hook.py::test_bfloat16_is_orthogonalised_as_torch_does_it":
        "imports torch (about 0.8 s) to compare with its hook's orthogonalisation",
    # data: each case runs whole epochs twice (interrupted and not) through the loader
    "unit/core/data/test_data_resume_seeds.py":
        "46 cases, each replaying two loaders' epochs to compare resumed and uninterrupted runs",
    # import graph: each runs a fresh interpreter that loads numpy and core's ops (scipy too)
    "unit/test_import_graph.py::test_a_process_group_loads_no_scipy_grpc_or_rpc_agent":
        "a fresh interpreter imports numpy, core's ops and the tcp backend",
    "unit/test_import_graph.py::test_the_agent_of_shoal_run_loads_no_numpy_scipy_grpc_or_rpc_agent":
        "a fresh interpreter imports the agent, prometheus_client and cryptography",
    "unit/test_import_graph.py::test_cores_namespace_loads_no_scipy":
        "a fresh interpreter builds core's namespace",
    "unit/test_import_graph.py::test_core_submodules_load_on_first_use":
        "a fresh interpreter imports scipy's fft, linalg and special",
    "unit/launcher/test_settings_check.py::test_shoal_run_imports_the_rpc_layer_only_to_check_its_variables":
        "a fresh interpreter checks the settings, then imports the rpc layer (grpc, numpy)",
    # collectives
    "unit/collectives/backends/test_watchdog.py::test_monitored_barrier_passes_when_everyone_arrives":
        "ranks arrive one after another, seconds apart",
    "unit/collectives/backends/test_watchdog.py::test_group_timeout_names_laggards_and_writes_a_valid_dump":
        "waits out the group's timeout",
    "unit/collectives/backends/test_watchdog.py::test_dump_lists_recent_collectives":
        "waits out a collective's timeout",
    "unit/core/profiler/test_profiler_kineto.py::test_a_training_step_exports_as_torch_exports_it":
        "imports torch and runs torch.profiler beside shoal's (5 s)",
    "unit/core/profiler/test_profiler_kineto.py::test_collectives_carry_torchs_collective_arguments_and_shoals":
        "forms and shuts down a real tcp process group",
    "unit/collectives/backends/tcp/test_pg_tcp.py::test_tcp_transport_on_request":
        "waits out a timeout",
    "unit/collectives/backends/tcp/test_pg_tcp.py::test_garbage_and_unauthenticated_connections_are_dropped_and_logged":
        "teardown waits out the dropped connections",
    "unit/collectives/backends/tcp/test_pg_tcp.py::test_p2p_mismatch_fails_only_that_recv":
        "teardown waits out the failed recv",
    "unit/collectives/backends/tcp/test_link_buffers.py::test_links_within_a_host_keep_fixed_buffers_on_both_ends":
        "moves tens of MiB through each link",
    "unit/collectives/backends/tcp/test_link_buffers.py::test_tcp_links_to_our_own_routable_address_keep_fixed_buffers":
        "moves tens of MiB through each link",
    "unit/collectives/backends/nccl/test_nccl_unavailable_fake_runtime.py::test_mismatched_collectives_are_named":
        "waits out the stand-in's timeout",
    "unit/collectives/ddp/test_ddp_threaded.py::test_uneven_inputs_without_join_end_in_a_collective_error":
        "waits out the collective timeout that uneven inputs end in",
    "unit/collectives/store/test_store_tcp_faults.py::test_silent_connection_stalls_nobody_and_is_dropped":
        "waits until the server drops the silent connection",
    "unit/collectives/store/test_store_tcp_faults.py::test_a_port_that_accepts_and_never_speaks_is_not_blamed_on_the_secret":
        "waits out the handshake timeout",
    "unit/collectives/test_torch_compat_ddp.py::test_a_hook_future_that_never_completes_times_out_with_the_group":
        "waits out the group's timeout",
    "unit/collectives/test_torch_compat_errors.py::test_no_server_is_a_dist_network_error":
        "waits out a connect timeout",
    "unit/collectives/test_torch_compat_errors.py::test_a_real_collective_timeout_is_caught_where_torchs_gloo_timeout_is":
        "waits out a collective timeout",
    "unit/collectives/test_torch_compat_stores.py::test_append_and_delete_key_on_etcd":
        "starts a real etcd server",
    "contracts/test_process_group_contract.py::TestNCCLStandIn::test_mismatched_calls_raise_collective_mismatch_naming_both":
        "the stand-in finds a mismatch only at its one-second timeout",
    # core
    "unit/core/utils/test_checkpoint_torch.py":
        "torch's first checkpoint call imports torch._dynamo (about a second)",
    "unit/core/vision/test_vision_io.py::test_the_example_decodes_in_dataloader_workers":
        "runs examples/decode_images.py, which starts two DataLoader worker processes",
    "unit/core/test_admission.py::test_an_accept_loop_rests_while_descriptors_run_out_and_accepts_again":
        "the accept loop rests for its back-off before accepting again",
    "unit/core/data/test_data_loader.py::test_spawned_workers_give_the_same_batches_as_forked_ones":
        "starts spawned worker processes (a fresh interpreter each)",
    "unit/core/data/test_data_loader_failures.py::test_the_timeout_counts_from_the_request_while_other_workers_deliver":
        "waits out a worker timeout",
    "unit/core/data/test_data_loader_failures.py::test_the_timeout_is_honoured_and_names_the_worker":
        "waits out a worker timeout",
    "unit/core/data/test_data_reshard.py::test_lockstep_resize_property":
        "a hypothesis property over many resized jobs",
    # rpc_agent
    "unit/rpc_agent/dist_autograd/test_dist_autograd_threads.py":
        "peers as threads, lost and joining while contexts end",
    "unit/rpc_agent/test_rpc_init_secret.py::test_the_store_keeper_holding_the_workers_secret_is_not_refused":
        "waits out a rendezvous timeout",
    # elastic
    "unit/elastic/agent/test_store_host_watch.py::test_a_short_blip_is_forgiven":
        "the blip lasts over a second",
    "unit/elastic/rendezvous/test_rdzv_state_machine.py::test_a_backend_outage_longer_than_the_heartbeat_timeout_kills_nobody":
        "the outage outlasts the heartbeat timeout",
    "unit/elastic/rendezvous/test_rdzv_state_machine.py::test_dead_node_requests_restart_and_survivors_form_the_next_round":
        "waits out the dead node's heartbeat timeout",
    "unit/elastic/rendezvous/test_rdzv_state_machine.py::test_a_forming_round_drops_a_joiner_that_died":
        "waits out the dead joiner's heartbeat timeout",
    "unit/elastic/rendezvous/test_rdzv_state_machine.py::test_one_node_short_of_min_times_out_naming_who_joined":
        "waits out the join timeout",
    "unit/elastic/rendezvous/test_rdzv_generation_and_waiting.py::test_a_forming_round_logs_whom_it_waits_for":
        "waits out the join timeout",
    "unit/elastic/rendezvous/test_rdzv_join_outage.py::test_a_running_round_never_gives_up_on_the_backend":
        "the outage outlasts the grace",
    "unit/elastic/rendezvous/test_rdzv_join_outage.py::test_an_outage_shorter_than_the_grace_only_delays_the_join":
        "the outage lasts over a second",
    "unit/elastic/rendezvous/test_rdzv_join_outage.py::test_a_waiting_node_gives_up_after_the_outage_grace_with_one_clear_line":
        "waits out the outage grace",
    "unit/elastic/test_elastic_state.py::test_sync_gives_every_rank_rank_0s_state":
        "spawns two rank processes over a TCPStore",
    "unit/elastic/test_metrics_observability.py::test_ranks_this_node_no_longer_runs_leave_the_scrape":
        "waits for scrapes a scrape interval apart",
    "unit/elastic/test_metrics_observability.py::test_stop_waits_for_the_next_scrape_of_a_steady_scraper":
        "waits for the next scrape",
    "unit/elastic/test_metrics_server_limits.py::test_a_scrape_succeeds_while_300_idle_connections_are_held":
        "opens and holds 300 connections",
    "unit/elastic/rendezvous/test_rdzv_meet_again.py::test_a_dead_backend_after_a_round_ends_the_join_one_budget_after_the_round_ended":
        "waits out the join outage budget",
    "unit/collectives/backends/tcp/test_framing.py::test_collectives_run_sealed_with_shoal_encrypt":
        "its teardown waits for the sealed group's links to close",
    "unit/collectives/backends/tcp/test_framing_chunks.py":
        "all_reduces of 2-9 MiB over TCP links at W=2 and W=3 (0.1-0.3 s each)",
    "unit/torch_bridge/test_torch_store_contract.py":
        "the store contract over torch's stores: deliberate 0.2 s timeouts, 2 s together",
    "unit/collectives/test_distributed_checkpoint.py::test_the_export_is_one_safetensors_file_torch_reads":
        "imports torch through safetensors.torch (3 s when nothing imported it before)",
}


# The contract suites' tests that wait out a short timeout on purpose (0.3-0.6 s each, about 20 s
# together across the backends): what they check is the timeout's error, so they run in the
# whole suite and keep the fast loop under two minutes.
_CONTRACT_WAITS = {
    "contracts/test_process_group_contract.py": (
        ("TestTCPSharedMemory", "TestTCPUnixSockets", "TestTCPLoopback", "TestNCCLStandIn"),
        ("test_timeout_names_the_ranks_that_never_arrived",
         "test_monitored_barrier_names_the_absent_ranks",
         "test_failed_async_work_reports_its_exception",
         "test_mismatched_calls_raise_collective_mismatch_naming_both",
         "test_abort_fails_this_rank_at_once_and_the_others_within_their_timeout")),
    "contracts/test_store_contract.py": (
        ("TestHashStore", "TestPrefixStoreOverHashStore", "TestTCPStoreServedHere",
         "TestTCPStoreServedByAnotherProcess", "TestFileStore", "TestPrefixStoreOverTCPStore"),
        ("test_multi_get_waits_and_times_out_naming_missing_keys",)),
    "contracts/test_rendezvous_backend_contract.py": (
        ("TestStoreBackendOverHashStore", "TestStoreBackendOverTCPStore", "TestEtcdBackend",
         "TestDefaultWatchOfTheABC"),
        ("test_watch_wakes_on_a_change_and_times_out_otherwise",)),
}
SLOW_TESTS.update({f"{path}::{cls}::{test}": "waits out a short timeout on purpose"
                   for path, (classes, tests) in _CONTRACT_WAITS.items()
                   for cls in classes for test in tests})


def _named_slow(path: Path, nodeid: str) -> bool:
    """Whether the test at `path` with `nodeid` is, or sits in, an entry of SLOW_TESTS."""
    key = path.relative_to(_TESTS).as_posix() + nodeid[len(nodeid.partition("::")[0]):]
    return any(key == name or key.startswith((name + "::", name + "[")) for name in SLOW_TESTS)


def _check_slow_tests_exist() -> None:
    """A renamed or moved test would silently rejoin the fast loop: refuse names that are gone."""
    shared = "".join(file.read_text() for file in (_TESTS / "support").glob("*.py"))
    for name in SLOW_TESTS:
        path, _, test = name.partition("::")
        file = _TESTS / path
        function = test.rpartition("::")[2]
        # A contract class's tests are defined once in tests/support and inherited.
        if not file.is_file() or (function and f"def {function}(" not in file.read_text() + shared):
            raise pytest.UsageError(
                f"tests/conftest.py names the slow test {name!r}, which does not exist: "
                "update SLOW_TESTS to the test's new name or place")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker, so it sees these markers
def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test under SLOW_FOLDERS and every test SLOW_TESTS names."""
    _check_slow_tests_exist()
    slow_roots = [_TESTS / folder for folder in SLOW_FOLDERS]
    for item in items:
        path = Path(str(item.path)).resolve()
        if any(root in path.parents for root in slow_roots) or (
                _TESTS in path.parents and _named_slow(path, item.nodeid)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def no_secret(monkeypatch):
    """No secret anywhere in the environment: shoal falls back to its development token."""
    for name in ("SHOAL_AUTH_TOKEN", "SHOAL_AUTH_TOKEN_FILE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
