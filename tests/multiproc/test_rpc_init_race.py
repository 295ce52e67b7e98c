"""init_rpc either succeeds or fails on every worker within its timeout, naming the missing
worker (issue 24).

The start-up race: the lower-id worker must not dial a higher-id worker before that one has
recorded the worker table (its hello was rejected as an unknown worker, with no retry). A test
hook widens the window deterministically: worker 1 records its table two seconds late. The
issue saw the race most with file:// init, so it runs over env:// and file://.

Faults: a worker process really killed during init - the one hosting the tcp:// store (the
others lose the store and must say that rank 0 is gone, in seconds, not at the timeout), or
another one (the rest time out naming it) - and the store host stopped (SIGSTOP) while the
others wait: slow is not gone, so they time out naming it instead of calling it lost.

Rank 0 binds the store's port itself (port 0) and publishes the port the kernel gave it in a
file; no port is picked in advance.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

import pytest

from shoal import rpc_agent
from shoal.collectives.store.prefix import PrefixStore
from shoal.collectives.store.tcp import TCPStore
from shoal.rpc_agent import rpc as rpc_module
from tests.support.ranks import Ranks
from tests.support.rpc_workers import RpcWorkers

pytestmark = pytest.mark.timeout(120)


def _late_table(agent) -> None:
    if agent.info.id == 1:
        time.sleep(2.0)


def start(delay_table: bool, init_timeout: float, init_method: str = "env://"):
    if delay_table:
        rpc_module._before_set_workers = _late_table
    rank = int(os.environ["RANK"])
    begin = time.monotonic()
    try:
        rpc_agent.init_rpc(
            f"w{rank}", rank, 2,
            rpc_agent.RpcBackendOptions(init_method=init_method, init_timeout=init_timeout),
        )
    except rpc_agent.RpcError as exc:
        return "error", str(exc), time.monotonic() - begin
    return "ok", rpc_agent.rpc_sync(f"w{1 - rank}", len, ("ab",)), time.monotonic() - begin


def stop():
    rpc_agent.shutdown()


@pytest.mark.parametrize("scheme", ["env", "file"])
def test_a_worker_that_records_the_table_late_is_not_rejected(scheme, tmp_path):
    init_method = "env://" if scheme == "env" else f"file://{tmp_path / 'rendezvous'}"
    with RpcWorkers(2, init=False) as pool:
        ids = [pool.submit(r, start, True, 30.0, init_method) for r in range(2)]
        outcomes = [pool.result(i, timeout=60) for i in ids]
        assert [o[:2] for o in outcomes] == [("ok", 2), ("ok", 2)], outcomes
        for r in range(2):
            pool.submit(r, stop)
        pool.close()


def test_a_missing_worker_fails_init_on_the_other_within_its_timeout_naming_it():
    with RpcWorkers(2, init=False) as pool:
        status, message, seconds = pool.run(0, start, False, 3.0, timeout=30)
        assert status == "error"
        assert "rank(s) 1 never joined" in message, message
        assert seconds < 10
        pool.close()


# ----------------------------------------------------------------------------- killed workers

def _host_store_port(port_file: str) -> TCPStore:
    """Rank 0: bind the rendezvous store on port 0 and publish its port in `port_file`.

    The store is multi-tenant, so the master store that init_rpc opens on the same port shares
    this server: rank 0 still hosts the rendezvous store, as it does with tcp://."""
    holder = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=60,
                      wait_for_workers=False)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(holder.port))
    os.replace(port_file + ".tmp", port_file)  # readers never see a half-written port
    return holder


def _published_port(port_file: str, timeout: float = 60.0) -> int:
    """The port rank 0 published in `port_file`, waiting for it up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(port_file):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Rank 0 published no store port in {port_file} within {timeout:g}s.")
        time.sleep(0.02)
    with open(port_file) as f:
        return int(f.read())


def _stall(agent) -> None:
    """Hold this worker between reading the worker table and recording it, until killed."""
    if agent.info.id == int(os.environ["STALL_RANK"]):
        time.sleep(600)


def _init_and_report(rank: int, world: int, port_file: str, init_timeout: float):
    """init_rpc over tcp:// (rank 0 hosts the store); rank 2 of three never starts it."""
    if rank == 2:
        return "absent"
    if "STALL_RANK" in os.environ:
        rpc_module._before_set_workers = _stall
    holder: Optional[TCPStore] = _host_store_port(port_file) if rank == 0 else None
    try:
        port = _published_port(port_file)
        begin = time.monotonic()
        try:
            rpc_agent.init_rpc(f"w{rank}", rank=rank, world_size=world,
                               rpc_backend_options=rpc_agent.RpcBackendOptions(
                                   init_method=f"tcp://127.0.0.1:{port}",
                                   init_timeout=init_timeout))
        except Exception as exc:  # noqa: BLE001  (the test checks its type)
            return (type(exc).__name__, str(exc), time.monotonic() - begin,
                    isinstance(exc, rpc_agent.RpcError), isinstance(exc, RuntimeError))
        rpc_agent.shutdown()
        return "ok"
    finally:
        if holder is not None:
            holder.close()


def _wait_for(port: int, keys: list[str]) -> None:
    """Block until the rendezvous store (served by rank 0) holds `keys` of init_rpc's."""
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=60, wait_for_workers=False)
    try:
        PrefixStore("shoal_rpc", client).wait(keys, 60)
    finally:
        client.close()


def test_the_store_host_killed_while_the_others_wait_to_join_is_named_in_seconds(tmp_path):
    port_file = str(tmp_path / "store_port")
    with Ranks(_init_and_report, 3, args=(port_file, 60.0)) as ranks:
        port = _published_port(port_file)
        _wait_for(port, ["worker/0", "worker/1"])  # both joined; rank 2 never will
        ranks.kill(0)
        kind, message, seconds, is_rpc_error, is_runtime_error = ranks.results(30, [1])[1][1]
    assert kind == "RpcPeerLost" and is_rpc_error and is_runtime_error, (kind, message)
    assert message.startswith(
        f"RPC: worker 'w1' (rank 1) could not finish init_rpc: worker rank 0, which hosts the "
        f"rendezvous store of tcp://127.0.0.1:{port}, is gone (it died or gave up its own "
        f"init_rpc), so rank 0 is missing."), message
    assert seconds < 30, seconds  # the lost connection, not init_timeout (60 s)


def test_the_store_host_killed_after_the_others_joined_is_named_in_seconds(tmp_path):
    port_file = str(tmp_path / "store_port")
    with Ranks(_init_and_report, 2, args=(port_file, 60.0), env={"STALL_RANK": "0"}) as ranks:
        # Rank 1 is through; it waits for rank 0 to connect.
        _wait_for(_published_port(port_file), ["connected/1"])
        ranks.kill(0)
        kind, message, seconds, is_rpc_error, _ = ranks.results(30, [1])[1][1]
    assert kind == "RpcPeerLost" and is_rpc_error, (kind, message)
    assert "worker rank 0, which hosts the rendezvous store" in message, message
    assert "so rank 0 is missing" in message, message
    assert seconds < 30, seconds


def test_a_worker_killed_during_init_is_named_by_the_others_timeout(tmp_path):
    # 10 s: long enough that a slow spawn on a loaded machine cannot change which message
    # comes (rank 1 must have joined before rank 0's wait for the table runs out).
    port_file = str(tmp_path / "store_port")
    with Ranks(_init_and_report, 2, args=(port_file, 10.0), env={"STALL_RANK": "1"}) as ranks:
        _wait_for(_published_port(port_file), ["worker/0", "worker/1"])
        ranks.kill(1)
        kind, message, seconds, is_rpc_error, _ = ranks.results(60, [0])[0][1]
    assert kind == "RpcTimeout" and is_rpc_error, (kind, message)
    assert message == ("RPC: worker 'w0' waited in init_rpc 10s, but rank(s) 1 never recorded "
                       "the worker table."), message
    assert 9.5 <= seconds < 40, seconds  # the timeout, neither much earlier nor a hang


def test_a_stopped_store_host_is_a_timeout_naming_it_not_a_lost_peer(tmp_path):
    """Rank 0 hosts the store and is stopped (SIGSTOP) while rank 1 waits on it: its connection
    stays open but silent. Rank 1 must time out naming rank 0, not say it is gone."""
    port_file = str(tmp_path / "store_port")
    with Ranks(_init_and_report, 3, args=(port_file, 6.0)) as ranks:
        port = _published_port(port_file)
        _wait_for(port, ["worker/0", "worker/1"])  # both joined; rank 2 never will
        ranks.kill(0, signal.SIGSTOP)
        try:
            kind, message, seconds, is_rpc_error, _ = ranks.results(90, [1])[1][1]
        finally:
            ranks.kill(0, signal.SIGCONT)
        # Continued, rank 0 finds its own init_timeout over and fails init as a timeout too.
        rank0 = ranks.results(60, [0])[0][1]
        ranks.join(30, [0, 1])
    assert kind == "RpcTimeout" and is_rpc_error, (kind, message)
    assert message.startswith(
        f"RPC: worker 'w1' (rank 1) could not finish init_rpc: worker rank 0, which hosts the "
        f"rendezvous store of tcp://127.0.0.1:{port}, did not answer in time (it is stopped or "
        f"overloaded), so rank 0 is missing. The store call failed with: TCPStore "), message
    # Which call went unanswered depends on where the stop caught rank 1 (the reply to its own
    # set of worker/1, or its wait for rank 2); either way the server never answered it.
    assert f"the server at 127.0.0.1:{port} did not answer within " in message, message
    assert 6 <= seconds < 60, seconds
    assert rank0[0] == "RpcTimeout" and rank0[3], rank0
