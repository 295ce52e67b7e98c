"""Bootstrapping RPC workers: init names every worker, a second init is refused, a timeout
names the ranks that never joined and duplicate names fail (the pool itself is
tests/support/rpc_workers.py)."""

from __future__ import annotations

import time

from tests.support.rpc_workers import RpcWorkers, expect_error


def _info_of(name_or_rank):
    from shoal import rpc_agent

    info = rpc_agent.get_worker_info(name_or_rank)
    return info.name, info.id


def _init_again():
    from shoal import rpc_agent

    rpc_agent.init_rpc("again", 0, 1)


def _init_as(name: str, rank: int, world_size: int, port: int, init_timeout: float,
             prefix: str):
    """init_rpc against the store at `port`; returns the error text (or "ok") and the time."""
    from shoal import rpc_agent
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", port, timeout=10)
    t = time.monotonic()
    try:
        rpc_agent.init_rpc(
            name, rank, world_size,
            rpc_agent.RpcBackendOptions(store=store, init_timeout=init_timeout,
                                        store_prefix=prefix),
        )
    except rpc_agent.RpcError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t
    rpc_agent.shutdown()
    return "ok", time.monotonic() - t


def test_init_names_every_worker_and_rejects_a_second_init():
    with RpcWorkers(2) as workers:
        assert workers.run(0, _info_of, "w1") == ("w1", 1)
        assert workers.run(1, _info_of, 0) == ("w0", 0)
        assert workers.run(1, _info_of, None) == ("w1", 1)
        type_name, message, _ = expect_error(workers, 0, _info_of, "w9")
        assert type_name == "RpcError"
        assert "Unknown worker 'w9'" in message and "'w0', 'w1'" in message
        type_name, message, _ = expect_error(workers, 0, _init_again)
        assert type_name == "RpcError" and "already initialized" in message
        workers.shutdown()


def test_init_timeout_names_the_ranks_that_never_joined_and_duplicate_names_fail():
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, wait_for_workers=False)
    try:
        with RpcWorkers(2, init=False) as workers:
            message, elapsed = workers.run(0, _init_as, "w0", 0, 3, store.port, 2.0, "alone")
            assert message.startswith("RpcTimeout: "), message
            assert "rank(s) 1, 2 never joined" in message, message
            assert elapsed < 8
            ids = [workers.submit(r, _init_as, "twin", r, 2, store.port, 20.0, "twins")
                   for r in range(2)]
            for task_id in ids:
                message, _ = workers.result(task_id)
                assert message.startswith(
                    "RpcError: Two workers are named 'twin' (ranks 0 and 1)"), message
    finally:
        store.close()
